"""``python -m fastprompt.cli``: the ``fastprompt`` command (``torchrun -m fastprompt.cli train ...`` too)."""
from fastprompt.cli import run

if __name__ == "__main__":
    run()

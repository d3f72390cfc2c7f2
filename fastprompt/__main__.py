"""``python -m fastprompt``: the ``fastprompt`` command (``torchrun -m fastprompt train ...`` too)."""
from fastprompt.cli import run

if __name__ == "__main__":
    run()

"""``python -m fastprompt``: the ``fastprompt`` command (``torchrun -m fastprompt train ...`` too)."""
import sys

from fastprompt.cli import main

if __name__ == "__main__":
    sys.exit(main())

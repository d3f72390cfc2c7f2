"""Command-line pieces shared by the subcommands' modules (standard library only: ``fastprompt -h`` stays light).

Every package's command module (``fastprompt.train.cli``, ``fastprompt.data.ski.cli``, ...) may import from here;
nothing imports ``fastprompt.cli``, the top of the package (the layering is checked by ``lint-imports``).
"""
from __future__ import annotations

import argparse


def add_trust_remote_code_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """--trust-remote-code: the only way a model folder's own Python code runs (fastprompt.remote_code)."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help=prefix + "let a model whose folder names its own Python code (auto_map in config.json) run "
                        "it; without it such a model is refused and no code of it runs. Read the code first")


def positive_int(text: str) -> int:
    """argparse ``type=`` of an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value

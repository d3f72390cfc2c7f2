"""Command-line arguments that the ``fastprompt`` subcommands and the methods' own commands share: argument types
and flags (:func:`positive_int`, ``--trust-remote-code``) and the training-config options (``--config``, ``--set``).

Standard library only, and below every layer that adds a subcommand: a method's command (a method's registration
brings it, ``docs/methods.md``) builds its parser from these without importing the command line package.
:mod:`fastprompt.cli.options` adds what only the command line has (the model options, and the functions that turn
the options into an encoder or a config).
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


def add_config_args(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    """--config/-c (a YAML recipe) and --set KEY=VALUE (repeatable), read by
    :func:`fastprompt.cli.options.load_config_args`."""
    p.add_argument("--config", "-c", required=required,
                   help="YAML recipe (keys: fastprompt train --help-config)" + ("" if required else
                                                                                 "; defaults if omitted"))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable; the value is parsed as YAML: 1e-3, true, null)")
    add_trust_remote_code_arg(p, "shorthand for --set trust_remote_code=true: ")

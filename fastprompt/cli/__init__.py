"""The ``fastprompt`` command line: ``fastprompt train | eval | encode | ...`` (``fastprompt SUBCOMMAND -h``).

One module per subcommand group. :data:`SUBCOMMANDS` lists the commands every run uses; a method's own tools
(SKICSE's ``generate-ski``/``join-ski``, CRTD's ``make-replacements``, a method of your own) are named by its
registration (``MethodSpec.commands``, :mod:`fastprompt.methods`) and added from there. Adding a subcommand: in a
module of this package, write ``add_<name>_parser(subparsers) -> ArgumentParser`` that creates its parser and
calls ``set_defaults(func=run_<name>)``, where ``run_<name>(args) -> int`` is the exit status; then add the
function to :data:`SUBCOMMANDS`, or name it (``"module:add_<name>_parser"``) in the method's registration. At
import time the modules use only the standard library and fastprompt's standard-library helpers
(:mod:`fastprompt.choices`, :mod:`fastprompt.io`); heavy imports (torch, transformers, the package's own modules)
belong inside ``run_*`` so that ``fastprompt -h`` stays fast. :mod:`fastprompt.cli.options` holds what
several subcommands share: ``positive_int``, ``--trust-remote-code``, the model options (``add_model_args``,
``load_encoder``) and the training config options (``add_config_args``, ``load_config_args``).

This package is the top layer: nothing else in fastprompt imports it (``lint-imports`` checks it). ValueError,
OSError (a missing file, a full disk, ...) and ImportError raised by a subcommand are reported as
``fastprompt <name>: error: ...`` with exit status 2, without a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from fastprompt.cli.encode import add_encode_parser
from fastprompt.cli.eval import add_eval_parser
from fastprompt.cli.gguf import add_convert_gguf_parser
from fastprompt.cli.integrations import add_export_parser, add_import_parser
from fastprompt.cli.mine import add_mine_negatives_parser
from fastprompt.cli.report import add_report_parser
from fastprompt.cli.train import add_train_parser
from fastprompt.cli.tune import add_tune_parser

#: The subcommands every method shares, in ``fastprompt -h`` order (the methods' own follow them).
SUBCOMMANDS: tuple[Callable[..., argparse.ArgumentParser], ...] = (
    add_train_parser,
    add_eval_parser,
    add_encode_parser,
    add_report_parser,
    add_export_parser,
    add_import_parser,
    add_mine_negatives_parser,
    add_convert_gguf_parser,
    add_tune_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastprompt", description="Deep-prompt contrastive sentence embeddings: train, evaluate, encode.")
    from fastprompt._version import __version__

    parser.add_argument("--version", action="version", version=f"fastprompt {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add_parser in SUBCOMMANDS:
        add_parser(subparsers)
    from fastprompt.methods import commands, load  # importing it registers the built-in methods

    for name, target in commands().items():
        if name in subparsers.choices:
            raise ValueError(f"a method's subcommand {name!r} is taken by another subcommand")
        load(target)(subparsers)
    return parser


def run() -> None:
    """The ``fastprompt`` console script and ``python -m fastprompt(.cli)``: :func:`main`, then exit with its status.

    An interrupted command (status 130: Ctrl-C or SIGTERM) has written and synced everything it keeps by then, and
    exits at once, without the interpreter's teardown: tearing down the thousands of classes that openai (SKI
    generation) or torch define took seconds on a loaded machine, long after the user asked it to stop (what made
    the Ctrl-C test of generate-ski flaky)."""
    code = main()
    if code == 130:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    """The ``fastprompt`` command on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "training_inputs", False):  # a method's command over a training config
            from fastprompt.cli.options import TrainingInputs

            return int(args.func(args, TrainingInputs(args)) or 0)
        return int(args.func(args) or 0)
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a missing optional package
        print(f"fastprompt {args.command}: error: {exc}", file=sys.stderr)
        return 2

"""The ``fastprompt`` command line as a whole: help, version, subcommand registry, exit statuses."""
import re
import subprocess
import sys

import pytest

from fastprompt import cli
from fastprompt.cli.options import load_config_args


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("eval", "encode", "report", "generate-ski", "join-ski", "make-replacements", "mine-negatives"):
        assert re.search(rf"^    {name}\b", out, re.M), name


def test_help_imports_neither_torch_nor_transformers():
    """Every subcommand's parser is built for ``fastprompt -h``: heavy imports must wait for ``run_*``."""
    code = ("import sys, contextlib, io\n"
            "from fastprompt import cli\n"
            "for argv in (['-h'], ['train', '-h'], ['eval', '-h'], ['encode', '-h'], ['report', '-h'],\n"
            "             ['generate-ski', '-h'], ['join-ski', '-h'], ['make-replacements', '-h'],\n"
            "             ['mine-negatives', '-h']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        cli.main(argv)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'yaml', 'matplotlib') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "usage: fastprompt" in capsys.readouterr().err


def test_unknown_option_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--sts-dir", "x", "--pooler", "max"])
    assert exc.value.code == 2
    assert "invalid choice: 'max'" in capsys.readouterr().err


def test_every_registered_subcommand_builds_and_has_a_runner():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    from fastprompt.methods import commands

    # the shared subcommands, then the methods' own (named by their registrations), each once
    assert len(sub.choices) == len(cli.SUBCOMMANDS) + len(commands())
    assert set(commands()) <= set(sub.choices)
    for name, p in sub.choices.items():
        assert callable(p.get_default("func")), name


@pytest.mark.parametrize("module", ["fastprompt", "fastprompt.cli"])
def test_module_entry_point_runs(module):
    out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("fastprompt ")


@pytest.mark.parametrize("command,extra", [("train", []), ("make-replacements", ["--output", "r.jsonl"])])
def test_config_reading_commands_take_config_and_set_alike(tmp_path, command, extra):
    """`--config/-c` and repeatable `--set` come from one helper (cli.options.add_config_args) and resolve alike."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch_size: 16\nlearning_rate: 1e-2\n", encoding="utf-8")
    args = cli.build_parser().parse_args([command, "-c", str(recipe), "--set", "batch_size=32",
                                          "--set", "max_length=24", *extra])
    assert args.overrides == ["batch_size=32", "max_length=24"]
    config = load_config_args(args, seed=7)
    assert (config.batch_size, config.learning_rate, config.max_length, config.seed) == (32, 1e-2, 24, 7)


@pytest.mark.parametrize("code", [0, 2, 130])
def test_the_console_script_exits_an_interrupted_command_without_the_interpreter_teardown(monkeypatch, code):
    """Status 130 (Ctrl-C, SIGTERM): os._exit after flushing (tearing down openai's or torch's classes took seconds
    under load: the generate-ski Ctrl-C test's flakiness); any other status: sys.exit."""
    import fastprompt.cli as cli_module

    exits = []

    def record(how):
        def exit_(c):
            exits.append((how, c))
            raise SystemExit(c)  # neither returns
        return exit_

    monkeypatch.setattr(cli_module, "main", lambda argv=None: code)
    monkeypatch.setattr(cli_module.os, "_exit", record("os._exit"))
    monkeypatch.setattr(cli_module.sys, "exit", record("sys.exit"))
    with pytest.raises(SystemExit):
        cli_module.run()
    assert exits == [("os._exit" if code == 130 else "sys.exit", code)]

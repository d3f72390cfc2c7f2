"""The integrations' command line and package stay light: no torch or transformers before a command runs."""
import subprocess
import sys

from fastprompt import cli


def test_export_and_import_are_registered():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"export", "import"} <= set(sub.choices)


def test_help_and_package_import_stay_light():
    code = ("import sys, contextlib, io\n"
            "import fastprompt.integrations\n"
            "from fastprompt import cli\n"
            "for argv in (['export', '-h'], ['import', '-h']):\n"
            "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "        cli.main(argv)\n"
            "heavy = ('torch', 'transformers', 'sentence_transformers', 'peft', 'mteb')\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_package_exports_resolve_lazily():
    import fastprompt.integrations as integrations

    for name in integrations.__all__:
        assert callable(getattr(integrations, name)), name

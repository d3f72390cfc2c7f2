"""The integrations' command line and package stay light: no torch or transformers before a command runs."""
import subprocess
import sys

import pytest

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


def _snapshot(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("command,where", [
    (command, where) for command in ("export-st", "export-peft", "import-peft")
    for where in ("parent", "grandparent", "inside", "symlink-to-parent", "base-model-parent")
    if (command, where) != ("export-peft", "base-model-parent")])  # export --to peft reads no base model
def test_overwrite_never_replaces_a_folder_holding_the_input(tiny_bert_dir, tmp_path, capsys, command, where):
    """--output runs/x with --prompt runs/x/best --overwrite would have wiped the whole run, input included; an
    output inside the input would have changed it. Both are refused, even with --overwrite, before anything loads."""
    from fastprompt.integrations.peft import export_peft
    from fastprompt.model import PromptConfig, PromptEncoder

    run = tmp_path / "runs" / "x"
    ckpt = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2)).save(run / "best")
    (run / "train_log.csv").write_text("step,loss\n1,0.5\n")
    source = ckpt if command.startswith("export") else export_peft(ckpt, run / "adapter")
    (tmp_path / "link").symlink_to(run)
    output = {"parent": run, "grandparent": tmp_path / "runs", "inside": source / "sub",
              "symlink-to-parent": tmp_path / "link", "base-model-parent": tiny_bert_dir.parent}[where]
    before, model_before = _snapshot(tmp_path / "runs"), _snapshot(tiny_bert_dir)
    if command.startswith("export"):
        args = ["export", "--to", "peft" if command == "export-peft" else "sentence-transformers", "--prompt",
                str(source)] + (["--model", str(tiny_bert_dir)] if command == "export-st" else [])
    else:
        args = ["import", "--from", "peft", "--checkpoint", str(source), "--model", str(tiny_bert_dir)]
    capsys.readouterr()
    assert cli.main([*args, "--output", str(output), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("holds the input" in err or "is inside the input" in err), err
    assert _snapshot(tmp_path / "runs") == before and _snapshot(tiny_bert_dir) == model_before

"""The config reference is generated from the dataclasses: the committed docs/config.md must be current."""
import dataclasses
from pathlib import Path

from fastprompt.train.config import KEYS, SECTIONS
from fastprompt.train.config_doc import config_reference_markdown, config_reference_text

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_config_reference_is_current():
    assert DOC.read_text(encoding="utf-8") == config_reference_markdown(), (
        "docs/config.md is stale: run `python -m fastprompt.train.config_doc > docs/config.md`")


def test_every_key_is_documented_once_in_its_section():
    md = config_reference_markdown()
    for key in KEYS:
        assert md.count(f"| `{key}` |") == 1, key
    for cls, title in SECTIONS.values():
        assert f"\n## {title}\n" in md
        for f in dataclasses.fields(cls):
            assert f.metadata["help"] and "\n" not in f.metadata["help"]


def test_help_config_prints_the_keys_grouped_by_section(capsys):
    from fastprompt.cli import main

    assert main(["train", "--help-config"]) == 0
    out = capsys.readouterr().out
    assert out == config_reference_text()
    lines = out.splitlines()
    optim = lines.index(next(line for line in lines if line.startswith("optimisation:")))
    assert lines[optim + 2].split()[:3] == ["learning_rate", "float", "0.03"]
    assert "attn_backend" in out and "(auto | triton | cpu | reference)" in out

"""The built-in methods' registrations: what each names exists (docs page, callables, subcommands), and training
reads its lists from them (config sections, objective choices, identity keys)."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from fastprompt.methods import BUILTIN, METHODS, load
from fastprompt.methods.registry import MethodSpec

ROOT = Path(__file__).resolve().parents[2]
SPECS = list(METHODS.values())  # the built-in ones (collected before any test registers its own)


def test_every_builtin_folder_registered_one_method():
    folders = sorted(p.name for p in (ROOT / "fastprompt" / "methods").iterdir() if (p / "__init__.py").exists())
    assert folders == sorted(BUILTIN)
    assert len(SPECS) == len(BUILTIN)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_what_a_registration_names_exists(spec: MethodSpec):
    assert (ROOT / spec.doc).is_file(), spec.doc
    for what in ("objective", "terms", "collator", "embed"):
        target = getattr(spec, what)
        if target is not None:
            assert callable(load(target)), (what, target)
    subparsers = argparse.ArgumentParser().add_subparsers()
    for command, target in spec.commands.items():
        load(target)(subparsers)
        assert command in subparsers.choices


def test_training_reads_its_sections_choices_and_identity_keys_from_the_registrations():
    from fastprompt.objectives.config import OBJECTIVE_REGISTRY
    from fastprompt.train.config import RUN_IDENTITY_KEYS, SECTIONS

    method_sections = [s.section[0] for s in SPECS if s.section is not None]
    assert [name for name in SECTIONS if name in method_sections] == method_sections
    assert method_sections == ["ski", "mlm", "rtd", "templates"]
    assert list(OBJECTIVE_REGISTRY) == [s.name for s in SPECS if s.objective is not None]
    for spec in SPECS:
        if spec.section is not None:
            flagged = [f.metadata.get("key") or f.name for f in dataclasses.fields(spec.section[1])
                       if f.metadata.get("identity")]
            assert flagged and set(flagged) <= set(RUN_IDENTITY_KEYS), spec.name


def test_the_cli_has_every_subcommand_a_method_brings():
    from fastprompt.cli import build_parser
    from fastprompt.methods import commands

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands()) == {"generate-ski", "join-ski", "make-replacements"} <= set(sub.choices)



def test_a_methods_commands_live_in_its_own_folder():
    """The command line reaches a method's commands through its registration only: the built-ins' parsers are in
    their method's folder (fastprompt/methods/<name>/commands.py), and no method names a command-line module."""
    for spec in SPECS:
        for command, target in spec.commands.items():
            module = target.partition(":")[0] if isinstance(target, str) else target.__module__
            assert module.startswith(f"fastprompt.methods.{spec.name}."), (spec.name, command, module)
    for path in (ROOT / "fastprompt" / "methods").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert '"fastprompt.cli' not in text and "from fastprompt.cli" not in text, path

"""The public API does not move under users: every import the README and the docs show works (without a
deprecation warning: the docs use the current paths), every name that moved still imports from its old place with
one FutureWarning naming the new one (fastprompt/_moved.py), and docs/api.md lists the API as it is."""
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import api_doc  # noqa: E402

from fastprompt import _moved  # noqa: E402

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
IMPORT = re.compile(r"^\s*(from (fastprompt[\w.]*) import ([\w, ()]+)|import (fastprompt[\w.]*))", re.M)
DOTTED = re.compile(r"`(fastprompt(?:\.[a-z_]\w*)+(?:\.[A-Z]\w*)?)`")


def _doc_imports():
    found = set()
    for path in DOCS:
        for m in IMPORT.finditer(path.read_text(encoding="utf-8")):
            if m.group(4):
                found.add((path.relative_to(ROOT).as_posix(), m.group(4), None))
            else:
                for name in m.group(3).replace("(", "").replace(")", "").split(","):
                    if name.strip():
                        found.add((path.relative_to(ROOT).as_posix(), m.group(2), name.strip().split(" as ")[0]))
    return sorted(found, key=str)


def _resolve(dotted: str):
    """Import ``a.b.c`` as a module, or ``a.b`` and its attribute ``c``."""
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        module, _, attr = dotted.rpartition(".")
        return getattr(_resolve(module), attr)


@pytest.mark.parametrize("doc,module,name", _doc_imports(), ids=lambda x: str(x))
def test_every_import_the_docs_show_works_without_a_warning(doc, module, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        mod = importlib.import_module(module)
        if name is not None:
            assert hasattr(mod, name), f"{doc}: from {module} import {name}"


def test_every_dotted_name_the_docs_mention_resolves():
    """`fastprompt.x.y` / `fastprompt.x.Y` in backquotes: a module, or a name in one."""
    bad = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        if path.name == "api.md":  # its table of moved names names the old places on purpose
            text = text.split("## Names that moved")[0]
        for m in DOTTED.finditer(text):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", FutureWarning)
                    _resolve(m.group(1))
            except Exception as exc:  # noqa: BLE001 (the message lists every failure)
                bad.append(f"{path.relative_to(ROOT)}: {m.group(1)} ({type(exc).__name__})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("old,new", sorted(_moved.MOVED.items()))
def test_a_moved_name_imports_from_its_old_place_with_one_warning(old, new, monkeypatch):
    monkeypatch.setattr(_moved, "_warned", set())
    module, _, attr = old.rpartition(".")
    with pytest.warns(FutureWarning, match=re.escape(f"{old} moved to {new}")):
        got = getattr(importlib.import_module(module), attr) if not _is_module(old) else importlib.import_module(old)
        if _is_module(old):
            got = _moved.resolve(old)
    assert got is _resolve(new)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _moved.resolve(old)  # once per name


def _is_module(old: str) -> bool:
    return (ROOT / (old.replace(".", "/") + ".py")).is_file()


def test_the_old_module_paths_serve_their_names():
    _moved._warned.discard("fastprompt.objectives.simcse")
    with pytest.warns(FutureWarning, match="fastprompt.objectives.simcse moved"):
        from fastprompt.objectives.simcse import SimCSE, split_views
    from fastprompt.methods.simcse.objective import SimCSE as new_simcse
    from fastprompt.methods.simcse.objective import split_views as new_split

    assert SimCSE is new_simcse and split_views is new_split


def test_docs_api_md_is_current():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        expected = api_doc.api_markdown()
    assert (ROOT / "docs" / "api.md").read_text(encoding="utf-8") == expected, (
        "docs/api.md is out of date: .venv/bin/python scripts/api_doc.py > docs/api.md")

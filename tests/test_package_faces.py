"""The lazy package faces (``__init__.py`` files serving names through ``fastprompt._lazy.lazy_getattr``): every
exported name imports, is in ``__all__``, and is imported under ``TYPE_CHECKING`` from the module that defines it,
so that IDEs and type checkers see the definitions that the run-time ``__getattr__`` hides from them."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FACES = sorted(p for p in (ROOT / "fastprompt").rglob("__init__.py") if "lazy_getattr" in p.read_text())


def _package(path: Path) -> str:
    return ".".join(path.parent.relative_to(ROOT).parts)


def _lazy_table(tree: ast.Module) -> dict[str, str]:
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "_LAZY")
    return ast.literal_eval(node.value)


def _type_checking_imports(tree: ast.Module, package: str) -> dict[str, str]:
    """exported name -> absolute module, from the ``if TYPE_CHECKING:`` block (``from m import A as A``)."""
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    out = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.unparse(node)
        module = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        for alias in node.names:
            # `A as A` is the explicit re-export type checkers honour (PEP 484)
            assert alias.asname == alias.name, f"{package}: write `{alias.name} as {alias.name}`"
            out[alias.name] = module
    return out


def test_the_faces_are_found():
    assert {_package(p) for p in FACES} >= {"fastprompt", "fastprompt.model", "fastprompt.train", "fastprompt.data",
                                            "fastprompt.objectives", "fastprompt.integrations"}


@pytest.mark.parametrize("path", FACES, ids=_package)
def test_every_lazy_name_is_listed_under_type_checking_and_imports(path):
    package = _package(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    table = {name: importlib.util.resolve_name(module, package) for name, module in _lazy_table(tree).items()}
    assert _type_checking_imports(tree, package) == table
    face = importlib.import_module(package)
    assert set(face.__all__) - {"__version__"} == set(table)
    for name, module in table.items():
        assert getattr(face, name) is getattr(importlib.import_module(module), name), name

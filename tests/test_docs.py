"""What README.md and docs/ promise the reader: every documented import works, the README's headline
benchmark rows are the committed measurements, and the README stays short.

Import lines are taken from anywhere in the Markdown (code blocks, diffs, ``python -c "..."``): every
``from fastprompt... import ...`` and ``import fastprompt...`` statement is parsed and executed, names included,
so renaming a documented module or function fails here instead of in a reader's terminal.
"""
import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_IMPORT = re.compile(r"(?<![\w.])(from\s+fastprompt[\w.]*\s+import\s+(?:\([^)]*\)|[\w, ]+)|import\s+fastprompt[\w.]*)")


def documented_imports() -> list[tuple[str, str]]:
    found = []
    for path in DOCS:
        for match in _IMPORT.finditer(path.read_text(encoding="utf-8")):
            statement = " ".join(match.group(1).split()).rstrip(", ")
            found.append((path.relative_to(ROOT).as_posix(), statement))
    return sorted(set(found))


def test_the_docs_document_imports():
    statements = [s for _, s in documented_imports()]
    assert len(statements) >= 15
    assert "from fastprompt import PromptEncoder, PromptConfig, Trainer" in statements


@pytest.mark.parametrize("where,statement", documented_imports())
def test_documented_import_works(where, statement):
    node = ast.parse(statement).body[0]
    if isinstance(node, ast.Import):
        for alias in node.names:
            importlib.import_module(alias.name)
        return
    module = importlib.import_module(node.module)
    missing = [a.name for a in node.names if not hasattr(module, a.name)
               and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
    assert not missing, f"{where}: `{statement}`: {node.module} has no {missing}"


def _table_rows(text: str, heading: str) -> list[str]:
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| global")]


def test_readme_headline_rows_are_the_committed_benchmark_rows():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    rows = _table_rows(readme, "## Speed and memory")
    assert 3 <= len(rows) <= 5
    for row in rows:
        assert row in bench, f"README row not in docs/benchmarks.md: {row}"


def test_readme_fits_three_screens():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200

"""docs/troubleshooting.md stays true: every message its tables quote is one the code can produce, and every row
names tests that exist.

A quoted message is cut at its placeholders (the upper-case names below, numbers, example paths, quoted values,
``...``); each literal piece left must be text of the package's source strings (f-strings and adjacent literals
joined as Python joins them): within one string, or across strings where a message is composed, one string's
text ending at a formatted field (``{...}``, ``%s``) that the next string's text fills. So a row cannot go on
quoting a message that the code has since reworded, as it once did (a binary train file, a YAML file that is
not UTF-8).
"""
import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "troubleshooting.md"
FIELD = "\x00"  # where a formatted value stands in a source string

# What a quoted message may write for the parts that vary: these names, numbers, example paths, quoted values,
# ellipses, and texts that the code passes on from the system, Python's codecs or its csv module. After "error: "
# comes the exception's own message, another string.
NAMES = ("PATH_OR_NAME", "PATH", "MODEL", "NAME", "FILES", "KEY", "SHAPE", "N", "B", "X", "C")
EXTERNAL = (r"No space left on device", r"Operation not permitted", r"invalid start byte", r"invalid continuation byte",
            r"field larger than field limit(?: \(\d+\))?")
PLACEHOLDER = re.compile("|".join((r"\.\.\.", r"\b(?:" + "|".join(NAMES) + r")\b", *EXTERNAL, r"\S*/\S*", r"'[^']*'",
                                   r"(?<![\w-])\d[\d.e+-]*\b", r"(?<=: error:) ")))
MIN_PIECE = 8  # shorter pieces (", ", "): ") say nothing about the message


@lru_cache(maxsize=1)
def _segments() -> tuple[frozenset, tuple]:
    """The literal texts of every string of the package, cut at its formatted fields (as a set and a tuple):
    each begins at the string's start or a field, and ends at a field or the string's end."""
    strings = []
    for path in (ROOT / "fastprompt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                strings.append("".join(v.value if isinstance(v, ast.Constant) else FIELD for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append(re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[sdifgeErx]", FIELD, node.value))
    whole = frozenset(seg for s in strings for seg in s.split(FIELD) if seg)
    return whole, tuple(whole)


def _produced(piece: str) -> bool:
    """``piece`` is text of one source string, or the end of one string's literal text before a field, whole
    literal texts between fields, and the start of one after a field (a message composed of several strings)."""
    whole, segments = _segments()
    if any(piece in seg for seg in segments):
        return True
    n = len(piece)
    # reach: the i such that piece[:i] is covered, ending at a field boundary
    reach = {i for i in range(1, n) if any(seg.endswith(piece[:i]) for seg in segments)}
    frontier = sorted(reach)
    while frontier:
        i = frontier.pop()
        if any(seg.startswith(piece[i:]) for seg in segments):
            return True
        for j in range(i + 1, n):
            if j not in reach and piece[i:j] in whole:
                reach.add(j)
                frontier.append(j)
    return False


def _rows() -> list[tuple[int, list[str], str | None]]:
    """(line number, cells, the row above's main test file) of every table's body rows. A row's main file is the
    first it names (a row that starts with ``::test_name`` keeps the main file of the row above)."""
    rows, lines, main = [], DOC.read_text(encoding="utf-8").splitlines(), None
    for i, line in enumerate(lines):
        if not line.startswith("|") or re.fullmatch(r"\|[-| ]+\|", line):
            continue
        if i + 1 < len(lines) and re.fullmatch(r"\|[-| ]+\|", lines[i + 1]):
            main = None  # a header: a new table
            continue
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows.append((i + 1, cells, main))
        first = re.search(r"(?:([\w/]+\.py))?::test_", cells[-1])
        main = (first.group(1) or main) if first else main
    return rows


def _quoted_messages(cell: str) -> list[str]:
    """The backticked spans of a cell that are messages (several words), without an exception's class name."""
    spans = [s for s in re.findall(r"`([^`]+)`", cell) if s.count(" ") >= 4]
    return [re.sub(r"^\w+(?:Error|Warning): ", "", s) for s in spans]


def _pieces(message: str) -> list[str]:
    return [p for p in (p.strip() for p in PLACEHOLDER.split(message)) if len(p) >= MIN_PIECE]


ROWS = _rows()


def test_the_doc_has_its_tables():
    assert len(ROWS) > 30 and all(len(cells) == 3 for _, cells, _ in ROWS), [n for n, c, _ in ROWS if len(c) != 3]


@pytest.mark.parametrize("line,cells,_", ROWS, ids=[f"line{n}" for n, _, _ in ROWS])
def test_quoted_messages_are_produced_by_the_code(line, cells, _):
    for message in _quoted_messages(cells[1]):
        for piece in _pieces(message):
            assert _produced(piece), f"line {line}: {piece!r} (of {message!r}) is in no message of the code"


@lru_cache(maxsize=1)
def _test_functions() -> dict[str, set[str]]:
    """tests/**/test_*.py -> the names of its test functions, keyed by every path suffix (test_x.py, train/...)."""
    out = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        names = {n.name for n in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
        parts = path.relative_to(ROOT / "tests").parts
        for k in range(len(parts)):
            out.setdefault("/".join(parts[k:]), set()).update(names)
    return out


@pytest.mark.parametrize("line,cells,current", ROWS, ids=[f"line{n}" for n, _, _ in ROWS])
def test_every_row_names_tests_that_exist(line, cells, current):
    """A row names ``file.py::test_name`` (``::test_name``: in the file named last in the row, or at its start in
    the row above's main file), or says ``same`` or gives only a parameter id (``[fewer-layers]``) of the row
    above's test."""
    functions = _test_functions()
    refs = re.findall(r"(?:([\w/]+\.py))?::(test_\w+)", cells[-1])
    if not refs:
        assert cells[-1] == "same" or re.fullmatch(r"`\[[\w-]+\]`", cells[-1]), f"line {line} names no test"
        return
    for file, name in refs:
        current = file or current
        assert current, f"line {line}: ::{name} follows no file"
        assert name in functions.get(current, ()), f"line {line}: no test {current}::{name}"

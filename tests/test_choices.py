"""fastprompt.choices is the one home of every closed set of choices: no other module spells one out again.

A scan of the package's source (and the kernels') for tuple literals of strings holding the same values as a
set of ``fastprompt.choices``, in any order. (A subset, such as ``("input", "both")`` for "the kinds with
soft input tokens", is a different set and is allowed.)
"""
import ast
from pathlib import Path

from fastprompt import choices

ROOT = Path(__file__).resolve().parents[1]
SETS = {name: value for name, value in vars(choices).items()
        if name.isupper() and isinstance(value, tuple) and all(isinstance(v, str) for v in value)}


def _string_tuples(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Tuple) and len(node.elts) >= 2
                and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)):
            yield node.lineno, tuple(e.value for e in node.elts)


def _copies(values: tuple[str, ...]) -> list[str]:
    """The sets of choices that ``values`` copies."""
    return [name for name, allowed in SETS.items() if set(values) == set(allowed)]


def test_no_module_copies_a_set_of_choices():
    files = [p for p in (*ROOT.glob("fastprompt/**/*.py"), *ROOT.glob("kernels/*.py")) if p.name != "choices.py"]
    copies = [f"{p.relative_to(ROOT)}:{line} {values} copies choices.{', '.join(names)}"
              for p in files for line, values in _string_tuples(p) if (names := _copies(values))]
    assert not copies, "import these from fastprompt.choices instead:\n" + "\n".join(copies)


def test_every_set_is_named_and_distinct():
    assert len(SETS) >= 20
    for name, values in SETS.items():
        assert len(set(values)) == len(values), f"{name} repeats a value"

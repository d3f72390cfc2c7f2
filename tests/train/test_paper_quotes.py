"""Every value a paper states is checked against the paper: its quote is in the text and holds the value.

tests/train/paper_values.yaml gives each value of a paper recipe a kind; a value of kind ``paper`` carries a
verbatim quote of the paper's text (../shared/papers/<paper>.txt). test_paper_values.py holds the recipes to the
YAML, so a wrong number written in the YAML, the recipe and the pins together passes there; here it fails:

- the quote holds the value (:func:`value_problems`; needs no text, so it runs everywhere): a number must appear
  in the quote itself, in any form :func:`numbers_in` reads (``3e-5``, ``3 × 10−5``, ``0.00003``, ``15%`` for
  0.15, ``ten``); with ``column`` the quote is a table row and the value must be that cell (a number compared as
  a number, True/False as a word); a word must appear in the quote as a whole word, case aside (``simcse`` in
  "SimCSE", ``cls`` in "[CLS]"); a value the paper states in other words (a model id, a data file, a mode) names
  them in ``says``, which must be in the quote (not allowed for a number: it must be in the quote);
- the quote is in the paper's text (:func:`occurrences`; skipped with the reason where ../shared is absent):
  exactly once, whitespace normalised (any run of spaces, tabs, newlines and no-break spaces matches any
  other; nothing else is: OCR slips, LaTeX and line-end hyphens are quoted as the .txt has them), and not as
  the middle of a longer word or number.

The deviations' quotes are checked the same way, and each recipe's reported STS numbers must be a row of the
paper its ``reported.source`` names.
"""
import importlib.util
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAPERS = ROOT.parent / "shared" / "papers"
_spec = importlib.util.spec_from_file_location("paper_recipes", ROOT / "scripts" / "paper_recipes.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
DATA = script.load()

_MINUS = "-−–"  # hyphen-minus, U+2212 (the papers' "10−5"), en dash
_NUMBER = re.compile(rf"""
    (?<![\w.])                                                        # not the tail of a word, index or number
    (?:
        (?P<mant>\d+(?:\.\d+)?)\s*[×x*]\s*10\s*\^?\s*\{{?\s*(?P<exp>[{_MINUS}+]?\s*\d+)\}}?    # 3 × 10−5, 3x10^-5
      | 10\s*\^\s*\{{?(?P<pow>[{_MINUS}+]?\d+)\}}?                                             # 10^6, 10^{{6}}
      | (?P<sci>\d+(?:\.\d+)?[eE][{_MINUS}+]?\d+)                                             # 3e-5, 1E-4
      | (?P<dec>\d{{1,3}}(?:,\d{{3}})+(?:\.\d+)?|\d*\.\d+|\d+)(?P<pct>\s*%)?                  # 100,000 0.05 32 15%
    )
    (?!\w)
""", re.X)
_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}


def _float(text: str) -> float:
    return float(re.sub(f"[{_MINUS}]", "-", re.sub(r"\s+", "", text)))


def numbers_in(text: str) -> list[float]:
    """Every number written in ``text``: digits (with a decimal point or thousands commas), scientific
    (3e-5), times a power of ten (3 × 10−5, 10^6), a percentage (15% reads as 0.15 and as 15) and the words
    zero to twenty. Digits inside a word or an index (STS12, lambda_1) are not numbers."""
    out = []
    for m in _NUMBER.finditer(text):
        if m["mant"]:
            out.append(_float(m["mant"]) * 10 ** _float(m["exp"]))
        elif m["pow"]:
            out.append(10 ** _float(m["pow"]))
        elif m["sci"]:
            out.append(_float(m["sci"]))
        else:
            x = _float(m["dec"].replace(",", ""))
            out += [x, x / 100] if m["pct"] else [x]
    out += [float(_WORDS[w.lower()]) for w in re.findall(r"\b[A-Za-z]+\b", text) if w.lower() in _WORDS]
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same(cell: str, value) -> bool:
    if isinstance(value, bool):
        return cell.lower() == str(value).lower()
    if _is_number(value):
        nums = numbers_in(cell)
        return len(nums) >= 1 and math.isclose(nums[0], value, rel_tol=1e-9)
    return False


def table_cells(row: str) -> list[str]:
    """The cells of a table row as the papers' texts print it: its label, then the trailing run of numbers and
    True/False words ("Learning rate 3e-2 3e-2 3e-2 1e-2" -> ["3e-2", "3e-2", "3e-2", "1e-2"])."""
    cells = []
    for token in reversed(row.split()):
        if not (token in ("True", "False") or _NUMBER.fullmatch(token)):
            break
        cells.insert(0, token)
    return cells


def value_problems(v: dict) -> list[str]:
    """Why a paper value's quote does not hold its value (empty when it does)."""
    value, quote = v["value"], " ".join(v["text"].split())
    if v["columns"]:
        cells = table_cells(quote)
        return [f"column {c} of {cells} is not {value!r}" for c in v["columns"]
                if not (1 <= c <= len(cells) and _same(cells[c - 1], value))]
    if v["says"] is not None:
        if _is_number(value):
            return [f"{value!r} is a number: it must be in the quote itself, not in says"]
        says = " ".join(v["says"].split())
        return [] if says and says in quote else [f"says {says!r} is not in the quote"]
    if _is_number(value):
        found = numbers_in(quote)
        return [] if any(math.isclose(x, value, rel_tol=1e-9) for x in found) else \
            [f"{value!r} is not among the quote's numbers {found}"]
    if isinstance(value, str) or isinstance(value, bool):
        word = str(value).lower()
        return [] if re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", quote, re.I) else \
            [f"{word!r} is not a word of the quote: add says"]
    return [f"{value!r} needs says: the words of the quote that state it"]


def occurrences(quote: str, text: str) -> int:
    """How many times ``quote`` is in ``text``, whitespace normalised, not starting or ending inside a word."""
    body = r"\s+".join(map(re.escape, quote.split()))
    pattern = (r"(?<!\w)" if quote.strip()[0].isalnum() else "") + body + \
              (r"(?!\w)" if quote.strip()[-1].isalnum() else "")
    return len(re.findall(pattern, text))


def _paper_values(data=DATA):
    for name, entry in data["recipes"].items():
        for key, v in entry["values"].items():
            if v["kind"] == "paper":
                yield name, key, v


def _changed(value):
    """A different value of the same kind, as a slip would write it: a lost or added digit, the other bool."""
    if isinstance(value, bool):
        return not value
    if _is_number(value):
        return value * 10 if value != 0 else 1
    return f"{value}-x"


@pytest.fixture(scope="module")
def papers_text() -> dict[str, str]:
    """The papers' texts by name, or a skip with the reason where ../shared/papers is absent (a user's clone)."""
    if not PAPERS.is_dir():
        pytest.skip(f"the papers' texts are not available: {PAPERS} does not exist")
    return {name: (PAPERS / info["text"]).read_text(encoding="utf-8")
            for name, info in DATA["papers"].items() if info["text"]}


@pytest.mark.parametrize(("text", "value"), [
    ("3e-5", 0.00003), ("3E-5", 0.00003), ("3 × 10−5", 0.00003), ("3x10^-5", 0.00003), ("0.00003", 0.00003),
    ("learning rate as 1e-4,", 0.0001), ("$\\tau = 0.05$", 0.05), ("15% tokens", 0.15), ("15% tokens", 15),
    ("for ten epochs", 10), ("$10^6$ sentences", 1e6), ("exceed 100,000", 100000), ("{64, 128, 256}", 128),
])
def test_the_number_reader_accepts_these_forms(text, value):
    assert any(math.isclose(x, value, rel_tol=1e-9) for x in numbers_in(text)), (text, numbers_in(text))


@pytest.mark.parametrize(("text", "value"), [
    ("0.055", 0.0055), ("5e-3", 0.05), ("STS12", 12), ("\\lambda_1 = 0.3", 1), ("BERT_{base}", 0),
    ("Table 3", 30), ("3e-2", 3),
])
def test_the_number_reader_rejects_these(text, value):
    assert not any(math.isclose(x, value, rel_tol=1e-9) for x in numbers_in(text)), (text, numbers_in(text))


def test_every_paper_value_holds_its_value():
    """Every quote holds its value (the number, the table cell, the word or the ``says`` words)."""
    problems = {f"{name}: {key}": value_problems(v) for name, key, v in _paper_values()}
    assert {k: p for k, p in problems.items() if p} == {}


def test_a_changed_value_fails_the_check():
    """The negative control: each paper value whose quote is checked literally (a number, a table cell, a word;
    not ``says``, which only links words a reviewer reads) fails once changed, every one of them."""
    checked = 0
    for name, key, v in _paper_values():
        if v["says"] is None:
            assert value_problems(dict(v, value=_changed(v["value"]))), (name, key)
            checked += 1
    assert checked > 250


def test_a_number_cannot_hide_behind_says():
    v = {"value": 0.05, "text": "We use the temperature τ = 0.05", "says": "temperature", "columns": []}
    assert value_problems(v) == ["0.05 is a number: it must be in the quote itself, not in says"]


def test_a_wrong_value_written_in_the_yaml_fails(tmp_path):
    """The case that passed before: D2CSE's supervised BERT learning rate written 0.0055 (Table 7 has 0.055) in
    the YAML; the recipe and its pins could say the same, and test_paper_values.py then passes. Here the quote's
    column 4 refuses it."""
    text = script.DATA.read_text(encoding="utf-8")
    old = "learning_rate: {value: 0.055, paper:"
    assert text.count(old) == 1
    (tmp_path / "values.yaml").write_text(text.replace(old, "learning_rate: {value: 0.0055, paper:"),
                                          encoding="utf-8")
    edited = script.load(tmp_path / "values.yaml")
    problems = {(name, key): value_problems(v) for name, key, v in _paper_values(edited)}
    bad = {k: p for k, p in problems.items() if p}
    assert list(bad) == [("d2cse-sup-bert-base.yaml", "learning_rate")]
    assert "column 4" in bad["d2cse-sup-bert-base.yaml", "learning_rate"][0]


def test_a_quote_edited_to_match_a_wrong_value_is_not_in_the_paper(papers_text):
    """And if the quote is edited to hold the wrong number, it is no longer the paper's text."""
    assert occurrences("Learning Rate 0.021 0.034 0.044 0.055 0.024", papers_text["D2CSE"]) == 1
    assert occurrences("Learning Rate 0.021 0.034 0.044 0.0055 0.024", papers_text["D2CSE"]) == 0
    # a quote matches whole words and numbers only: Table 3's row is not found again inside Table 4's
    # "Epoch 10 10 10 10", and a quote may not end inside a number
    assert occurrences("Epoch 1 1 1 1", papers_text["DCPCSE"]) == 1
    assert occurrences("Epoch 10 10 10 1", papers_text["DCPCSE"]) == 0


def test_every_quote_is_in_its_paper(papers_text):
    """Each quote (values and deviations) is in its paper's text exactly once, whitespace aside."""
    quotes = {(v["in"], v["text"]) for _, _, v in _paper_values()}
    quotes |= {(d["in"], d["paper"]) for d in DATA["deviations"]}
    bad = {q: n for q in sorted(quotes) if (n := occurrences(q[1], papers_text[q[0]])) != 1}
    assert bad == {}, "quotes not found exactly once (paper, quote): count"
    assert len(quotes) > 80


def _row_pattern(rep: dict) -> str:
    """The seven scores and the average as one row: two decimals (or one, where the paper drops a trailing zero),
    separated by whitespace, HTML tags (D2CSE's bold) or a ±std (PromptBERT's 10-seed means)."""
    nums = []
    for t in script.TASKS:
        forms = {f"{rep[t]:.2f}", f"{rep[t]:.2f}".rstrip("0")}
        nums.append("(?:" + "|".join(map(re.escape, sorted(forms, key=len, reverse=True))) + r")(?![\d])")
    return r"(?<![\d.])" + r"(?:\s|<[^>]*>|±\s*\d+\.\d+)+".join(nums)


def test_the_reported_numbers_are_a_row_of_the_paper(papers_text):
    checked = 0
    for name, entry in DATA["recipes"].items():
        rep = entry["reported"]
        if rep is None:
            continue
        paper = rep["source"].split()[0]
        assert re.search(_row_pattern(rep), papers_text[paper]), (name, rep["source"])
        checked += 1
    assert checked == sum(e["reported"] is not None for e in DATA["recipes"].values()) > 25

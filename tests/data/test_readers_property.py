"""Every text, CSV, TSV and JSONL reader against random and adversarial bytes (hypothesis): a correct result or a
ValueError/OSError with a one-line message naming the file; never another exception, a hang or a changed file."""
import hashlib
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from fastprompt.cli.encode import read_sentences
from fastprompt.data import load_train_file
from fastprompt.data.replacements import ReplacementTable, _read_lines
from fastprompt.data.ski.files import read_ski_csv
from fastprompt.eval.sts import load_sickr, load_sts_year, load_stsb
from fastprompt.methods.skicse.generation.store import read_records

# Pieces that break naive readers: quotes, separators, NUL, CR, BOM, invalid UTF-8, line separators, long cells.
_PIECES = st.sampled_from([b"sent0", b"sent1", b"hard_neg", b"ski", b"query", b"positive", b'"pos"', b'"neg"',
                           b",", b"\t", b'"', b"\n", b"\r\n", b"\r",
                           b"\x00", b"\xef\xbb\xbf", b"\xff\xfe", b"\xc3", b"\xe2\x80\xa8", b"\x85", b"a b", b"5.0",
                           b"nan", b"-inf", b"{", b"}", b"[", b"]", b'"ids"', b'"replaced"', b":", b"1", b"-1",
                           b"99999999999", b"1e400", b"null"])
_BYTES = st.one_of(st.binary(max_size=300), st.lists(_PIECES, max_size=40).map(b"".join))
_FIELD_LIMIT = b'sent0,sent1\n"' + b"x" * 140000 + b"\n"  # a quote that never closes runs past csv's field limit
SETTINGS = settings(max_examples=80, deadline=None)


def _write(tmp_path_factory, name: str, content: bytes) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("reader") / name
    path.write_bytes(content)
    return path, hashlib.sha256(content).hexdigest()


def _check_error(exc: BaseException) -> None:
    assert isinstance(exc, (ValueError, OSError)), repr(exc)
    text = str(exc)
    assert text and "\n" not in text and len(text) < 2000, text


def _unchanged(path: Path, digest: str) -> None:
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


@SETTINGS
@given(_BYTES, st.sampled_from(["train.txt", "train.csv", "train.tsv", "train.dat", "train.jsonl"]),
       st.sampled_from(["auto", "text", "csv", "tsv", "jsonl"]))
@example(_FIELD_LIMIT, "train.csv", "auto")
@example(b"sent0\tsent1\na\tb\n", "train.txt", "auto")
@example(b'{"query": "q", "pos": ["p"], "neg": ["n"]}\n', "train.jsonl", "auto")
@example(b'{"query": "q", "pos": ["p"]}\n{"query": "r", "pos": ["s"]}\n', "train.txt", "auto")
def test_any_training_file_is_rows_or_one_clear_error(tmp_path_factory, content, name, fmt):
    path, digest = _write(tmp_path_factory, name, content)
    try:
        examples = load_train_file(path, fmt=fmt)
        assert examples.rows and all(len(r) == len(examples.columns) and all(r) for r in examples.rows)
    except Exception as exc:  # noqa: BLE001 (the property: only ValueError/OSError)
        _check_error(exc)
    _unchanged(path, digest)


@SETTINGS
@given(_BYTES)
@example(b"sent0,ski\n" + b'"' + b"y" * 140000)
def test_any_ski_file_is_rows_or_one_clear_error(tmp_path_factory, content):
    path, digest = _write(tmp_path_factory, "ski.csv", content)
    try:
        assert all(len(r) == 2 for r in read_ski_csv(path).rows)
    except Exception as exc:  # noqa: BLE001
        _check_error(exc)
    _unchanged(path, digest)


@SETTINGS
@given(_BYTES)
@example(b"sent0,ski\na,\x00b\n")
def test_any_generate_ski_output_is_records_or_one_clear_error(tmp_path_factory, content):
    path, digest = _write(tmp_path_factory, "out.csv", content)
    try:
        assert all(len(r) == 2 for r in read_records(path, ("sent0", "ski")))
    except Exception as exc:  # noqa: BLE001
        _check_error(exc)
    _unchanged(path, digest)


@SETTINGS
@given(_BYTES)
def test_any_encode_input_is_sentences_or_one_clear_error(tmp_path_factory, content):
    path, digest = _write(tmp_path_factory, "sentences.txt", content)
    try:
        lines = read_sentences(path)
        assert lines and all(line.strip() for line in lines)
    except Exception as exc:  # noqa: BLE001
        _check_error(exc)
    _unchanged(path, digest)


@SETTINGS
@given(st.one_of(_BYTES, st.lists(st.fixed_dictionaries({"ids": st.lists(st.integers(-2**40, 2**40), max_size=4),
                                                         "replaced": st.lists(st.integers(-5, 2**33), max_size=4)}),
                                  max_size=4).map(lambda rs: "".join(__import__("json").dumps(r) + "\n"
                                                                     for r in rs).encode())))
@example(b'{"ids": "123", "replaced": "456"}\n')
@example(b'{"ids": [1e30], "replaced": [1]}\n')
def test_any_replacement_file_is_read_or_one_clear_error(tmp_path_factory, content):
    path, digest = _write(tmp_path_factory, "rep.jsonl", content)
    Path(f"{path}.meta.json").write_text("{}", encoding="utf-8")
    try:
        for ids, rep in _read_lines(path):
            assert len(ids) == len(rep) and all(isinstance(i, int) and 0 <= i < 2**31 for i in (*ids, *rep))
        ReplacementTable(path)
    except Exception as exc:  # noqa: BLE001
        _check_error(exc)
    _unchanged(path, digest)


@pytest.mark.parametrize("task", ["year", "stsb", "sickr"])
@settings(max_examples=60, deadline=None)
@given(content=_BYTES)
def test_any_sts_file_is_pairs_or_one_clear_error(tmp_path_factory, task, content):
    """One file of a task replaced by random bytes (the others well formed)."""
    from fastprompt.eval.sts import SICK_SPLITS, STS_YEAR_SUBSETS, STSB_SPLITS

    root = tmp_path_factory.mktemp("sts")
    if task == "year":
        folder, subsets = STS_YEAR_SUBSETS["sts13"]
        (root / folder).mkdir()
        for i, sub in enumerate(subsets):
            (root / folder / f"STS.input.{sub}.txt").write_bytes(b"a b\tc d\n")
            (root / folder / f"STS.gs.{sub}.txt").write_bytes(content if i == 0 else b"1.5\n")
        path, load = root / folder / f"STS.gs.{subsets[0]}.txt", lambda: load_sts_year(root, "sts13",
                                                                                       preprocess="none")
    elif task == "stsb":
        (root / "STSBenchmark").mkdir()
        path = root / "STSBenchmark" / STSB_SPLITS["test"]
        path.write_bytes(content)
        load = lambda: load_stsb(root, "test", preprocess="none")  # noqa: E731
    else:
        (root / "SICK").mkdir()
        path = root / "SICK" / SICK_SPLITS["test"]
        path.write_bytes(content)
        load = lambda: load_sickr(root, "test", preprocess="none")  # noqa: E731
    digest = hashlib.sha256(content).hexdigest()
    try:
        data = load()
        assert len(data.sentences1) == len(data.sentences2) == len(data.scores)
        assert all(abs(s) < float("inf") for s in data.scores)
    except Exception as exc:  # noqa: BLE001
        _check_error(exc)
    _unchanged(path, digest)

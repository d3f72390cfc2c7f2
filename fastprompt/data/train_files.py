"""The training-file dispatcher: which reader a ``train_file`` (or a ``mine-negatives`` input) goes to.

:func:`load_train_file` reads a text corpus, a ``sent0,sent1[,hard_neg]`` CSV/TSV (:mod:`fastprompt.data.corpus`),
query / positives / negatives rows (JSONL or CSV, :mod:`fastprompt.data.retrieval`), a ``sent0,ski`` file
(:mod:`fastprompt.data.ski.files`) or the embedded corpus (:mod:`fastprompt.data.builtin`), deciding by the extension
and the first line; :func:`load_query_rows` reads a file as query rows. It sits above the readers, which know
nothing of each other's layouts.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

from fastprompt.choices import TRAIN_FORMATS, check_choice
from fastprompt.data.corpus import (
    BUILTIN_WIKI,
    PAIR_COLUMNS,
    SKI_COLUMN,
    TrainExamples,
    is_ski_header,
    read_pair_csv,
    read_text_corpus,
)
from fastprompt.data.retrieval import QueryRows, query_header, read_query_csv, read_query_jsonl
from fastprompt.io import check_file


def _first_row(path: Path, delimiter: str) -> list[str] | None:
    """The cells of the first line of ``path`` (stripped), or None when it is not a row of that delimiter."""
    with open(path, "rb") as f:
        first = f.readline(1 << 16).decode("utf-8-sig", errors="replace").strip()
    try:
        return [c.strip() for c in next(csv.reader([first], delimiter=delimiter), [])]
    except csv.Error:
        return None


def _table_format(path: Path) -> str | None:
    """"csv" or "tsv" when the first line is a ``sent0,sent1...`` or ``query,positive...`` header (comma- or
    tab-separated), else None."""
    for fmt, delimiter in (("csv", ","), ("tsv", "\t")):
        cells = _first_row(path, delimiter)
        if cells is None:
            continue
        if cells[:2] in (list(PAIR_COLUMNS), ["sent0", SKI_COLUMN]) or (len(cells) > 1 and query_header(cells)):
            return fmt
    return None


def _refuse_tab_separated_corpus(examples: TrainExamples) -> None:
    """A corpus whose every line holds a tab is a table of pairs without a header, not sentences: read as text,
    each pair would become one "sentence" with a tab inside, silently."""
    if all("\t" in row[0] for row in examples.rows):
        raise ValueError(f"{examples.source}: every line holds a tab, so it looks like tab-separated pairs, which a "
                         "text corpus would read as one sentence per line; give it a header line sent0<TAB>sent1 "
                         "(it is then read as pairs), or set train_format=text to train on each line as one "
                         "sentence")


def _refuse_json_corpus(examples: TrainExamples) -> None:
    """A corpus whose every line is a JSON object is query/positive/negative rows (or another JSON file), not
    sentences: read as text, each JSON line would become one "sentence", silently."""
    if all(row[0].startswith("{") and row[0].endswith("}") for row in examples.rows):
        raise ValueError(f"{examples.source}: every line is a JSON object, so it looks like query/pos/neg rows, "
                         "which a text corpus would read as one sentence per line; name it .jsonl or set "
                         "train_format=jsonl to read the rows, or train_format=text to train on each line as one "
                         "sentence")


def load_train_file(path: str | Path, *, fmt: str = "auto", on_decode_error: str = "error",
                    negatives_per_row: int | None = None, pad_negatives: bool = False, seed: int = 0) -> TrainExamples:
    """Load ``path`` as a text corpus, a pair/triplet CSV, a ``sent0,ski`` SKI file, or query/positive/negative rows
    (JSONL or CSV).

    ``fmt="auto"`` decides by extension (``.csv`` -> CSV, ``.tsv`` -> tab-separated, ``.jsonl`` -> JSONL rows),
    otherwise (``.txt`` too) by whether the first line is a ``sent0,sent1...`` or ``query,positive...`` header, comma-
    or tab-separated; a CSV whose header names a ``query`` (or ``anchor``) and a ``positive`` column is read as
    query/positive/negative rows. A text corpus whose every line holds a tab (pairs without a header) or is a JSON
    object (JSONL rows) is refused unless ``fmt="text"``. ``negatives_per_row``, ``pad_negatives`` and ``seed``: how
    query rows become k negatives each (:meth:`fastprompt.data.retrieval.QueryRows.to_examples`; other files ignore
    them, and the trainer refuses ``negatives_per_row`` when no file of the run has query rows).
    ``path == "builtin:gensim-wiki"`` loads the embedded corpus.
    """
    if str(path) == BUILTIN_WIKI:
        from fastprompt.data.builtin import builtin_wiki_corpus

        return builtin_wiki_corpus()
    check_choice("train_format", fmt, TRAIN_FORMATS)
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"training file not found: {path} (relative paths are resolved against the current directory "
            f"{Path.cwd()}; use {BUILTIN_WIKI!r} for the corpus embedded in the gensim package)"
        )
    check_file(path, "training file")
    auto = fmt == "auto"
    fmt = _resolve_format(path, fmt)
    query_rows = _read_query_rows(path, fmt)
    if query_rows is not None:
        return query_rows.to_examples(negatives_per_row, pad_negatives=pad_negatives, seed=seed)
    if fmt == "csv" and is_ski_header(_first_row(path, ",") or []):
        from fastprompt.data.ski.files import read_ski_csv

        return read_ski_csv(path)  # sent0,ski: unsupervised SKICSE
    if fmt in ("csv", "tsv"):
        return read_pair_csv(path, delimiter="," if fmt == "csv" else "\t")
    examples = read_text_corpus(path, on_decode_error=on_decode_error)
    if auto:
        _refuse_tab_separated_corpus(examples)
        _refuse_json_corpus(examples)
    return examples


def _resolve_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl"}.get(path.suffix.lower()) or _table_format(path) or "text"


def _read_query_rows(path: Path, fmt: str) -> QueryRows | None:
    """The :class:`~fastprompt.data.retrieval.QueryRows` of ``path`` when its format holds them, else None."""
    if fmt == "jsonl":
        return read_query_jsonl(path)
    delimiter = "," if fmt == "csv" else "\t"
    if fmt in ("csv", "tsv") and query_header(_first_row(path, delimiter) or []):
        return read_query_csv(path, delimiter=delimiter)
    return None


def load_query_rows(path: str | Path, *, fmt: str = "auto") -> QueryRows:
    """``path`` as :class:`~fastprompt.data.retrieval.QueryRows` (every positive of a row kept together): query/pos/neg
    rows as they are, ``sent0,sent1[,hard_neg]`` rows as a query (sent0) with one positive (sent1) and their hard
    negative. A file of sentences alone is an error (it has no positives)."""
    check_choice("train_format", fmt, TRAIN_FORMATS)
    path = check_file(path, "input file")
    fmt = _resolve_format(path, fmt)
    rows = _read_query_rows(path, fmt)
    if rows is not None:
        return rows
    ex = load_train_file(path, fmt=fmt)
    if len(ex.columns) < 2:
        raise ValueError(f"{path} holds sentences only; this needs a query and its positive per row: query/pos JSONL, "
                         "a query,positive CSV, or a sent0,sent1[,hard_neg] CSV")
    return QueryRows([r[0] for r in ex.rows], [(r[1],) for r in ex.rows],
                     [(r[2],) if ex.has_hard_negatives else () for r in ex.rows], source=ex.source)


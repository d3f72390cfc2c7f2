"""Training-data readers: a text corpus (one sentence per line), SimCSE-style CSV pairs/triplets, and query /
positives / negatives rows (JSONL or CSV, :mod:`fastprompt.data.retrieval`).

Every reader returns a :class:`TrainExamples`: rows of 1 (unsupervised), 2 (pairs), 3 (triplets with a hard
negative) or 2 + k (a query, a positive and k negatives) sentences, plus counts of what was skipped, so the trainer
can log them.
"""
from __future__ import annotations

import csv
import io
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastprompt.choices import DECODE_ERROR_MODES, TRAIN_FORMATS, check_choice
from fastprompt.data.retrieval import query_header, read_query_csv, read_query_jsonl
from fastprompt.io import check_file, read_utf8_text, reject_binary
from fastprompt.messages import shown

logger = logging.getLogger(__name__)

#: Column layouts accepted in a CSV header (SimCSE's NLI layout and its pair variant).
PAIR_COLUMNS = ("sent0", "sent1")
TRIPLET_COLUMNS = ("sent0", "sent1", "hard_neg")
#: The column of a sentence's SKI (SKICSE's "sentence knowable information"): ``sent0,ski`` files written by
#: ``fastprompt generate-ski``, or NLI rows with the SKI of their premise appended (``fastprompt.data.ski``).
SKI_COLUMN = "ski"
#: The ``train_file`` value that selects the corpus embedded in the gensim wheel (see ``builtin.py``).
BUILTIN_WIKI = "builtin:gensim-wiki"


@dataclass
class TrainExamples:
    """Training rows. ``columns`` names the sentences of a row; every row has ``len(columns)`` strings.

    One column means unsupervised SimCSE: the collator feeds each sentence twice (two dropout views).
    """

    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    source: str = ""
    skipped: dict[str, int] = field(default_factory=dict)
    #: read from query/positive/negative rows (:mod:`fastprompt.data.retrieval`), which ``negatives_per_row`` shapes
    query_rows: bool = False

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def n_views(self) -> int:
        """Number of encoder views per row: 2 for a single sentence (dropout views), else the column count."""
        return 2 if len(self.columns) == 1 else len(self.columns)

    @property
    def has_hard_negatives(self) -> bool:
        return "hard_neg" in self.columns

    @property
    def num_negatives(self) -> int:
        """k: the negatives of each row (``hard_neg``, ``hard_neg_2``, ...)."""
        from fastprompt.data.retrieval import is_negative_column

        return sum(is_negative_column(c) for c in self.columns)


def _check_not_empty(path: Path, n: int, what: str, skipped: dict[str, int]) -> None:
    if n == 0:
        detail = ", ".join(f"{v} {k}" for k, v in skipped.items() if v) or "the file is empty"
        raise ValueError(f"training file {path} contains no {what} ({detail})")


def read_text_corpus(path: str | Path, *, on_decode_error: str = "error") -> TrainExamples:
    """Read one sentence per line (UTF-8). Empty/whitespace-only lines are skipped and counted.

    Lines that are not valid UTF-8 raise a ValueError naming their line numbers
    (``on_decode_error="error"``), or are skipped with a warning (``"skip"``).
    """
    check_choice("on_decode_error", on_decode_error, DECODE_ERROR_MODES)
    path = check_file(path, "training file")
    rows: list[tuple[str, ...]] = []
    n_empty = 0
    bad_lines: list[tuple[int, int]] = []  # (line number, byte offset of the first bad byte in that line)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            reject_binary(raw, path, lineno)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad_lines.append((lineno, e.start))
                continue
            if lineno == 1:
                text = text.lstrip("\ufeff")  # tolerate a UTF-8 byte-order mark
            text = text.strip()
            if not text:
                n_empty += 1
                continue
            rows.append((text,))
    if bad_lines:
        shown = ", ".join(f"line {ln} (byte {off})" for ln, off in bad_lines[:10])
        more = f" and {len(bad_lines) - 10} more" if len(bad_lines) > 10 else ""
        msg = f"{path}: {len(bad_lines)} line(s) are not valid UTF-8: {shown}{more}"
        if on_decode_error == "error":
            raise ValueError(msg + " (re-encode the file as UTF-8, or set on_decode_error=skip)")
        logger.warning("%s; skipped", msg)
    skipped = {"empty lines": n_empty, "undecodable lines": len(bad_lines)}
    _check_not_empty(path, len(rows), "sentences", skipped)
    if n_empty:
        logger.info("%s: skipped %d empty line(s)", path, n_empty)
    return TrainExamples(columns=("sent0",), rows=rows, source=str(path), skipped=skipped)


def parse_csv(text: str, path, *, delimiter: str = ",", hint: str = "") -> list[list[str]]:
    """Every record of CSV ``text`` (read from ``path``); a ValueError naming the file and line for what the csv
    module rejects (a quoted field that never closes and runs past its field limit, a NUL byte), then ``hint``."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        return list(reader)
    except csv.Error as exc:
        kind = "CSV" if delimiter == "," else "tab-separated"
        raise ValueError(f"{path}: not a valid {kind} file (line {reader.line_num}: {exc}){hint}") from None


def read_pair_csv(path: str | Path, *, delimiter: str = ",") -> TrainExamples:
    """Read a CSV with a header: ``sent0,sent1`` (pairs) or ``sent0,sent1,hard_neg`` (triplets), with a ``ski``
    column kept when present; a ``sent0,ski`` file is read by :func:`fastprompt.data.ski.read_ski_csv`.
    ``delimiter="\t"`` reads the same layout tab-separated (a ``.tsv`` file).

    Other columns are ignored. Rows with an empty required cell are skipped and counted.
    """
    path = Path(path)
    kind = "CSV" if delimiter == "," else "tab-separated"
    text = read_utf8_text(path, "training file", encoding="utf-8-sig")
    records = parse_csv(text, path, delimiter=delimiter,
                        hint="; the training file must be a sent0,sent1[,hard_neg] CSV or a .txt corpus")
    header = records.pop(0) if records else None
    if header is None:
        raise ValueError(f"training file {path} is empty (expected a {kind} header sent0,sent1[,hard_neg])")
    header = [h.strip() for h in header]
    if SKI_COLUMN in header and "sent1" not in header and delimiter == ",":
        from fastprompt.data.ski.files import read_ski_csv

        return read_ski_csv(path)  # sent0,ski: unsupervised SKICSE
    missing = [c for c in PAIR_COLUMNS if c not in header]
    if missing:
        raise ValueError(
            f"{kind} file {path} must have a header with columns sent0,sent1 (pairs) or sent0,sent1,hard_neg "
            f"(triplets, SimCSE's NLI layout); found columns {shown(header)}, missing {missing}"
        )
    columns = TRIPLET_COLUMNS if "hard_neg" in header else PAIR_COLUMNS
    if SKI_COLUMN in header:
        columns += (SKI_COLUMN,)  # NLI rows with the SKI of their premise: supervised SKICSE
    index = [header.index(c) for c in columns]
    ignored = [h for h in header if h not in columns]
    if ignored:
        logger.info("%s: ignoring extra CSV column(s) %s", path, ignored)
    rows: list[tuple[str, ...]] = []
    n_incomplete = 0
    for record in records:
        if not any(cell.strip() for cell in record):
            continue  # blank line
        cells = tuple(record[i].strip() if i < len(record) else "" for i in index)
        if not all(cells):
            n_incomplete += 1
            continue
        rows.append(cells)
    skipped = {"rows with an empty or missing cell": n_incomplete}
    _check_not_empty(path, len(rows), "complete rows", skipped)
    if n_incomplete:
        logger.warning("%s: skipped %d row(s) with an empty or missing cell", path, n_incomplete)
    return TrainExamples(columns=columns, rows=rows, source=str(path), skipped=skipped)


def _table_format(path: Path) -> str | None:
    """"csv" or "tsv" when the first line is a ``sent0,sent1...`` or ``query,positive...`` header (comma- or
    tab-separated), else None."""
    with open(path, "rb") as f:
        first = f.readline(1 << 16).decode("utf-8-sig", errors="replace").strip()
    for fmt, delimiter in (("csv", ","), ("tsv", "\t")):
        try:
            cells = [c.strip() for c in next(csv.reader([first], delimiter=delimiter), [])]
        except csv.Error:
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
    """Load ``path`` as a text corpus, a pair/triplet CSV, or query/positive/negative rows (JSONL or CSV).

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


def _read_query_rows(path: Path, fmt: str):
    """The :class:`~fastprompt.data.retrieval.QueryRows` of ``path`` when its format holds them, else None."""
    if fmt == "jsonl":
        return read_query_jsonl(path)
    if fmt in ("csv", "tsv") and _csv_has_query_header(path, "," if fmt == "csv" else "\t"):
        return read_query_csv(path, delimiter="," if fmt == "csv" else "\t")
    return None


def load_query_rows(path: str | Path, *, fmt: str = "auto"):
    """``path`` as :class:`~fastprompt.data.retrieval.QueryRows` (every positive of a row kept together): query/pos/neg
    rows as they are, ``sent0,sent1[,hard_neg]`` rows as a query (sent0) with one positive (sent1) and their hard
    negative. A file of sentences alone is an error (it has no positives)."""
    from fastprompt.data.retrieval import QueryRows

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


def _csv_has_query_header(path: Path, delimiter: str) -> bool:
    with open(path, "rb") as f:
        first = f.readline(1 << 16).decode("utf-8-sig", errors="replace").strip()
    try:
        cells = next(csv.reader([first], delimiter=delimiter), [])
    except csv.Error:
        return False
    return query_header(cells)

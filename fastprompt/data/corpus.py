"""The trainer's rows (:class:`TrainExamples`) and the readers of the plain layouts: a text corpus (one sentence per
line) and SimCSE-style CSV pairs/triplets.

Every reader returns a :class:`TrainExamples`: rows of 1 (unsupervised), 2 (pairs), 3 (triplets with a hard
negative) or 2 + k (a query, a positive and k negatives) sentences, plus counts of what was skipped, so the trainer
can log them. The other layouts build on this module: query / positives / negatives rows
(:mod:`fastprompt.data.retrieval`), SKI files (:mod:`fastprompt.data.ski.files`), the embedded corpus
(:mod:`fastprompt.data.builtin`); :func:`fastprompt.data.train_files.load_train_file` picks the reader of a file.
"""
from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fastprompt.choices import DECODE_ERROR_MODES, check_choice
from fastprompt.io import check_file, read_utf8_text, reject_binary
from fastprompt.messages import shown

logger = logging.getLogger(__name__)

#: Column layouts accepted in a CSV header (SimCSE's NLI layout and its pair variant).
PAIR_COLUMNS = ("sent0", "sent1")
#: The column of a row's (first) negative; a row with k negatives has ``hard_neg``, ``hard_neg_2``, ... ``hard_neg_k``.
NEGATIVE_COLUMN = "hard_neg"
TRIPLET_COLUMNS = (*PAIR_COLUMNS, NEGATIVE_COLUMN)
#: The column of a sentence's SKI (SKICSE's "sentence knowable information"): ``sent0,ski`` files written by
#: ``fastprompt generate-ski``, or NLI rows with the SKI of their premise appended (``fastprompt.data.ski``).
SKI_COLUMN = "ski"
#: The ``train_file`` value that selects the corpus embedded in the gensim wheel (see ``builtin.py``).
BUILTIN_WIKI = "builtin:gensim-wiki"
#: The longest line of a file of sentences (a text corpus, mining's ``--candidates``): a sentence or a passage is far
#: shorter; a longer "line" is a binary file or one without line breaks, and is never read whole.
MAX_TEXT_LINE_BYTES = 1 << 20


def is_negative_column(name: str) -> bool:
    """Whether ``name`` is the column of a row's negative (``hard_neg``, ``hard_neg_2``, ...)."""
    return name == NEGATIVE_COLUMN or re.fullmatch(rf"{NEGATIVE_COLUMN}_\d+", name) is not None


def is_ski_header(header: list[str]) -> bool:
    """Whether a CSV header is a ``sent0,ski`` file's (unsupervised SKICSE; not NLI rows with a ``ski`` column)."""
    return SKI_COLUMN in header and PAIR_COLUMNS[1] not in header


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
        return sum(is_negative_column(c) for c in self.columns)


def _check_not_empty(path: Path, n: int, what: str, skipped: dict[str, int]) -> None:
    if n == 0:
        detail = ", ".join(f"{v} {k}" for k, v in skipped.items() if v) or "the file is empty"
        raise ValueError(f"training file {path} contains no {what} ({detail})")


def text_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, raw bytes) of every line of ``path``, read a bounded line at a time: a ValueError naming the line
    for one longer than :data:`MAX_TEXT_LINE_BYTES` (before more of it is read) or holding a NUL byte (a binary
    file; found on the line it is on, however large the file)."""
    limit = MAX_TEXT_LINE_BYTES
    with open(path, "rb") as f:
        lineno = 0
        while raw := f.readline(limit + 1):
            lineno += 1
            reject_binary(raw, path, lineno)  # first: a binary file's "line" of zeros is named binary
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise ValueError(f"{path}:{lineno}: a line longer than {limit} bytes; a text file holds one sentence "
                                 "per line (is it a binary file, or one without line breaks?)")
            yield lineno, raw


def read_text_corpus(path: str | Path, *, on_decode_error: str = "error") -> TrainExamples:
    """Read one sentence per line (UTF-8). Empty/whitespace-only lines are skipped and counted.

    Lines that are not valid UTF-8 raise a ValueError naming their line numbers
    (``on_decode_error="error"``), or are skipped with a warning (``"skip"``). A binary file (a NUL byte) or a line
    longer than :data:`MAX_TEXT_LINE_BYTES` is an error (:func:`text_lines`).
    """
    check_choice("on_decode_error", on_decode_error, DECODE_ERROR_MODES)
    path = check_file(path, "training file")
    rows: list[tuple[str, ...]] = []
    n_empty = 0
    bad_lines: list[tuple[int, int]] = []  # (line number, byte offset of the first bad byte in that line)
    for lineno, raw in text_lines(path):
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
    column kept when present (a ``sent0,ski`` file is read by :func:`fastprompt.data.read_ski_csv`, and
    :func:`~fastprompt.data.train_files.load_train_file` reads either).
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
    if is_ski_header(header) and delimiter == ",":
        raise ValueError(f"{path} is a sent0,ski file (SKICSE's SKI), not pairs: read it with "
                         "fastprompt.data.read_ski_csv or fastprompt.data.load_train_file")
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


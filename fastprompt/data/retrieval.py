"""Query / positives / negatives rows: FlagEmbedding's JSONL and sentence-transformers-like CSV columns.

A row is a query (anchor), one or more positives and k >= 0 negatives of its own::

    {"query": "what is a cat", "pos": ["A cat is a small feline."], "neg": ["Dogs bark.", "Cars are fast."]}

JSONL keys (FlagEmbedding's, and sentence-transformers' column names): the query ``query`` or ``anchor``; the
positives ``pos``, ``positive`` or ``positives`` (a string or a list); the negatives ``neg``, ``negative`` or
``negatives`` (a string or a list; absent: none). Other keys (``pos_scores``, ``prompt``, ...) are ignored. A CSV or
TSV file with a header names them as columns: ``query``/``anchor``, ``pos``/``positive`` (more positives in
``positive_2``, ...), and any number of ``neg``/``negative``/``negative_1``/``hard_neg_2``/... columns; an empty
negative cell is a row with fewer negatives.

:func:`read_query_rows` reads a file into :class:`QueryRows`; :meth:`QueryRows.to_examples` turns them into the
trainer's fixed-width :class:`~fastprompt.data.corpus.TrainExamples`: one row per (query, positive) pair (a row with
P positives trains P rows, as sentence-transformers' pairs do; the batch sampler never puts two of them into one
batch, since they share their query), columns ``sent0`` (the query), ``sent1`` (the positive) and ``hard_neg``,
``hard_neg_2``, ... ``hard_neg_k`` (its negatives, the views after the positive: the fused loss reads them as k
negative columns per anchor). How ragged negative counts become k: :meth:`QueryRows.to_examples`.

Every input is bounded: a JSONL line has at most :data:`MAX_LINE_BYTES`, a row at most :data:`MAX_TEXTS_PER_ROW`
positives and as many negatives; a text is never empty (a row with an empty query, no positive, or an empty
positive or negative is an error naming its line, never silently dropped: such a row is a broken file).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fastprompt.data.corpus import NEGATIVE_COLUMN, PAIR_COLUMNS, TrainExamples, parse_csv
from fastprompt.io import check_file, read_utf8_text, reject_binary
from fastprompt.messages import shown

logger = logging.getLogger(__name__)

QUERY_KEYS = ("query", "anchor")
POSITIVE_KEYS = ("pos", "positive", "positives")
NEGATIVE_KEYS = ("neg", "negative", "negatives")
#: The largest JSONL line read (a query with 1024 passages of ~1 KB fits); longer is not such a row.
MAX_LINE_BYTES = 4 << 20
#: The most positives, and the most negatives, one row may have.
MAX_TEXTS_PER_ROW = 1024
#: The trainer's column names: the query, the positive, then the negatives (``hard_neg`` alone for k = 1, so one
#: negative per row is exactly SimCSE's NLI triplet).
QUERY_COLUMN, POSITIVE_COLUMN = PAIR_COLUMNS
#: The text of a padding negative (a row with fewer than k negatives, ``pad_negatives``): a NUL byte, which no text
#: read from a file has (the readers refuse binary files); it is encoded as an empty text and masked out of the loss.
PAD_TEXT = "\x00"

_CSV_QUERY = re.compile(r"(query|anchor)")
_CSV_POSITIVE = re.compile(r"(pos|positive)(_\d+)?")
_CSV_NEGATIVE = re.compile(r"(neg|negative|hard_neg)(_\d+)?")


def negative_columns(k: int) -> tuple[str, ...]:
    """The column names of k negatives: ``hard_neg``, ``hard_neg_2``, ... ``hard_neg_k``."""
    return tuple(NEGATIVE_COLUMN if j == 0 else f"{NEGATIVE_COLUMN}_{j + 1}" for j in range(k))


@dataclass
class QueryRows:
    """Rows of (query, positives, negatives), read from ``source``."""

    queries: list[str]
    positives: list[tuple[str, ...]]
    negatives: list[tuple[str, ...]]
    source: str = ""
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.queries)

    def negative_counts(self) -> tuple[int, int]:
        counts = [len(n) for n in self.negatives]
        return min(counts), max(counts)

    def to_examples(self, negatives_per_row: int | None = None, *, pad_negatives: bool = False, seed: int = 0):
        """Fixed-width training rows (see the module docstring) with k negatives each.

        ``negatives_per_row`` None: every row's negatives, whose counts must then be equal (a ValueError naming the
        counts otherwise). k given: a row with more than k negatives trains on a seeded sample of k of them (drawn
        once per run from ``seed`` and the row's position, so a resumed run draws the same); a row with fewer is an
        error, unless ``pad_negatives``: it is padded with :data:`PAD_TEXT` columns, which the loss leaves out of its
        softmax (their text id is negative).
        """
        lo, hi = self.negative_counts()
        if negatives_per_row is None:
            if lo != hi:
                raise ValueError(f"{self.source}: rows have between {lo} and {hi} negatives; set negatives_per_row=K "
                                 "(rows with more are sampled down to K; rows with fewer are an error unless "
                                 "pad_negatives=true, which masks the missing ones out of the loss)")
            k = hi
        else:
            k = int(negatives_per_row)
            if k < 0 or k > MAX_TEXTS_PER_ROW:
                raise ValueError(f"negatives_per_row must be in [0, {MAX_TEXTS_PER_ROW}], got {k}")
            if lo < k and not pad_negatives:
                short = sum(len(n) < k for n in self.negatives)
                first = next(i for i, n in enumerate(self.negatives) if len(n) < k)
                raise ValueError(f"{self.source}: {short} row(s) have fewer than negatives_per_row={k} negatives "
                                 f"(the first: row {first + 1}, with {len(self.negatives[first])}); lower "
                                 "negatives_per_row, or set pad_negatives=true to mask the missing ones out of the "
                                 "loss")
        rows: list[tuple[str, ...]] = []
        for i, (query, positives, negatives) in enumerate(zip(self.queries, self.positives, self.negatives)):
            if len(negatives) > k:
                pick = np.random.default_rng([int(seed), i]).choice(len(negatives), size=k, replace=False)
                negatives = tuple(negatives[j] for j in sorted(pick.tolist()))
            negatives = tuple(negatives) + (PAD_TEXT,) * (k - len(negatives))
            rows.extend((query, positive, *negatives) for positive in positives)
        columns = (QUERY_COLUMN, POSITIVE_COLUMN, *negative_columns(k))
        n_pad = sum(row.count(PAD_TEXT) for row in rows)
        if n_pad:
            logger.info("%s: %d padding negative(s) (rows with fewer than %d), masked out of the loss",
                        self.source, n_pad, k)
        return TrainExamples(columns=columns, rows=rows, source=self.source, skipped=dict(self.skipped),
                             query_rows=True)


def fewest_distinct(examples: TrainExamples) -> tuple[int, str]:
    """The fewest distinct texts a column of ``examples`` holds (padding negatives aside), with what they are, e.g.
    ``(1, "1 distinct query")``: a batch never holds a text twice, so no batch has more rows than that."""
    best = (0, "no text")
    for j, column in enumerate(examples.columns):
        n = len({row[j] for row in examples.rows} - {PAD_TEXT})
        if n and (best[0] == 0 or n < best[0]):
            if examples.query_rows:
                name = {QUERY_COLUMN: ("query", "queries"),
                        POSITIVE_COLUMN: ("positive", "positives")}.get(column, ("negative", "negatives"))
            else:
                name = (f"{column} text", f"{column} texts")
            best = (n, f"{n} distinct {name[n != 1]}")
    return best


def _unicode(text: str, what: str, where: str) -> str:
    """``text`` when it is valid Unicode without a NUL; a JSON escape can write a lone surrogate (``"\\ud800"``),
    which no UTF-8 text holds and no tokenizer takes, or a NUL (``"\\u0000"``), which the raw-byte check of the line
    cannot see: the trainer marks padding negatives with it (:data:`PAD_TEXT`), and ``mine-negatives`` would embed
    it as text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: not valid Unicode (the {what} holds a lone surrogate {text[e.start]!r} at "
                         f"character {e.start}; a JSON \\uXXXX escape of a surrogate needs its pair)") from None
    nul = text.find("\x00")
    if nul >= 0:
        raise ValueError(f"{where}: the {what} holds a NUL character at character {nul} (a JSON "
                         "\"\\u0000\"): no sentence holds one, and the trainer marks padding negatives with it; "
                         "remove it")
    return text


def _texts(value, what: str, where: str, *, required: bool) -> tuple[str, ...]:
    """A JSON value that is a string or a list of strings, as stripped non-empty texts."""
    if value is None:
        if required:
            raise ValueError(f"{where}: no {what}")
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(t, str) for t in items):
        raise ValueError(f"{where}: {what} must be a string or a list of strings, got {shown(value)}")
    if len(items) > MAX_TEXTS_PER_ROW:
        raise ValueError(f"{where}: {len(items)} {what}; a row has at most {MAX_TEXTS_PER_ROW}")
    texts = tuple(_unicode(t, what[:-1], where).strip() for t in items)
    if any(not t for t in texts):
        raise ValueError(f"{where}: an empty {what[:-1] if what.endswith('s') else what} text")
    if required and not texts:
        raise ValueError(f"{where}: no {what} (every row needs at least one positive)")
    return texts


def _one_key(record: dict, keys: tuple[str, ...], where: str):
    found = [k for k in keys if k in record]
    if len(found) > 1:
        raise ValueError(f"{where}: keys {found} name the same thing; keep one")
    return record[found[0]] if found else None


def read_query_jsonl(path: str | Path) -> QueryRows:
    """Read FlagEmbedding-style JSONL (one JSON object per line; blank lines are skipped)."""
    path = check_file(path, "training file")
    out = QueryRows([], [], [], source=str(path))
    with open(path, "rb") as f:
        for lineno in range(1, 1 << 62):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{where}: a line longer than {MAX_LINE_BYTES} bytes; not a row of queries, "
                                 "positives and negatives")
            reject_binary(raw, path, lineno)
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:  # before JSON, which would call it "not a JSON object"
                raise ValueError(f"{where}: not valid UTF-8 (byte {e.start} of the line: {e.reason}); re-encode the "
                                 "file as UTF-8") from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except (ValueError, RecursionError):
                raise ValueError(f"{where}: not a JSON object (expected a row such as "
                                 '{"query": "...", "pos": ["..."], "neg": ["..."]})') from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a JSON {type(record).__name__}, not an object with query, pos and neg")
            query = _one_key(record, QUERY_KEYS, where)
            if query is None:
                raise ValueError(f"{where}: no query (a non-empty string under one of {', '.join(QUERY_KEYS)}); "
                                 f"found keys {shown(sorted(record)[:10])}")
            if not isinstance(query, str):
                raise ValueError(f"{where}: the query must be a string, got {shown(query)}")
            if not query.strip():
                raise ValueError(f"{where}: an empty query")
            out.queries.append(_unicode(query, "query", where).strip())
            out.positives.append(_texts(_one_key(record, POSITIVE_KEYS, where), "positives", where, required=True))
            out.negatives.append(_texts(_one_key(record, NEGATIVE_KEYS, where), "negatives", where, required=False))
    if not out.queries:
        raise ValueError(f"training file {path} contains no rows (it is empty or blank)")
    return out


def query_header(header: list[str]) -> bool:
    """Whether a CSV header names a query/anchor column and a positive column (then :func:`read_query_csv`)."""
    names = [h.strip() for h in header]
    return any(_CSV_QUERY.fullmatch(h) for h in names) and any(_CSV_POSITIVE.fullmatch(h) for h in names)


def read_query_csv(path: str | Path, *, delimiter: str = ",") -> QueryRows:
    """Read a CSV (or, with ``delimiter="\\t"``, TSV) with a ``query``/``anchor``, ``positive`` and negative columns."""
    path = Path(path)
    text = read_utf8_text(path, "training file", encoding="utf-8-sig")
    records = parse_csv(text, path, delimiter=delimiter)
    header = [h.strip() for h in records.pop(0)] if records else []
    queries = [i for i, h in enumerate(header) if _CSV_QUERY.fullmatch(h)]
    positives = [i for i, h in enumerate(header) if _CSV_POSITIVE.fullmatch(h)]
    negatives = [i for i, h in enumerate(header) if _CSV_NEGATIVE.fullmatch(h)]
    if len(queries) != 1 or not positives:
        raise ValueError(f"{path}: a query/positive/negative file needs a header with one query (or anchor) column "
                         f"and a positive column; found columns {shown(header)}")
    if len(positives) > MAX_TEXTS_PER_ROW or len(negatives) > MAX_TEXTS_PER_ROW:
        raise ValueError(f"{path}: more than {MAX_TEXTS_PER_ROW} positive or negative columns")
    ignored = [h for i, h in enumerate(header) if i not in {*queries, *positives, *negatives}]
    if ignored:
        logger.info("%s: ignoring extra column(s) %s", path, ignored)
    out = QueryRows([], [], [], source=str(path))
    for lineno, record in enumerate(records, start=2):
        if not any(cell.strip() for cell in record):
            continue  # blank line
        cells = [c.strip() for c in record] + [""] * (len(header) - len(record))
        where = f"{path}: record {lineno}"
        if not cells[queries[0]]:
            raise ValueError(f"{where}: an empty query")
        pos = tuple(cells[i] for i in positives if cells[i])
        if not pos:
            raise ValueError(f"{where}: no positive (every row needs at least one)")
        out.queries.append(cells[queries[0]])
        out.positives.append(pos)
        out.negatives.append(tuple(cells[i] for i in negatives if cells[i]))
    if not out.queries:
        raise ValueError(f"training file {path} contains no rows (only a header)")
    return out

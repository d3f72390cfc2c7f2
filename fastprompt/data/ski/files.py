"""SKI files as training data, and the sentences a generation run reads.

Layouts (UTF-8 CSV with a header, any further columns ignored):

- ``sent0,ski`` — unsupervised SKICSE: a sentence and its SKI (what ``generate-ski`` writes).
- ``sent0,sent1,hard_neg,ski`` — supervised SKICSE: an NLI triplet (SimCSE's layout) and the SKI of its
  premise ``sent0``; :func:`join_ski` builds it from a triplet file and a SKI file, matching on ``sent0``.
"""
from __future__ import annotations

import csv
import io
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from fastprompt.data.corpus import TrainExamples, parse_csv, read_pair_csv
from fastprompt.io import read_utf8_lines, read_utf8_text, write_text_atomic

logger = logging.getLogger(__name__)

SKI_COLUMNS = ("sent0", "ski")
SKI_TRIPLET_COLUMNS = ("sent0", "sent1", "hard_neg", "ski")


def meta_path(path: str | os.PathLike) -> Path:
    """The metadata file ``generate-ski`` writes beside its ``sent0,ski`` output."""
    return Path(f"{path}.meta.json")


def _csv_reader(path: Path, what: str):
    text = read_utf8_text(path, what, encoding="utf-8-sig")  # also rejects a binary file
    torn = bool(text) and not text.endswith("\n") and meta_path(path).exists()
    if torn:  # generate-ski ends every row with a line break: an unterminated last line is a torn write
        text = text[: text.rfind("\n") + 1]
        logger.warning("%s: ignoring an incomplete last line (an interrupted generate-ski run)", path)
    reader = iter(parse_csv(text, path))
    header = [h.strip() for h in next(reader, [])]
    return reader, header, torn


def read_ski_csv(path: str | os.PathLike) -> TrainExamples:
    """Read ``sent0,ski`` rows. Rows with an empty cell, and repeats of a sentence (the first is kept), are
    skipped and counted in ``skipped``. A file ``generate-ski`` is still writing can be read: a torn last
    line (only possible while a run is being killed) is left out."""
    path = Path(path)
    reader, header, torn = _csv_reader(path, "SKI file")
    missing = [c for c in SKI_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"SKI file {path} must have the header sent0,ski (as written by fastprompt generate-ski); "
                         f"found columns {header}, missing {missing}")
    index = [header.index(c) for c in SKI_COLUMNS]
    rows, seen = [], set()
    n_incomplete = n_repeated = 0
    for record in reader:
        if not any(cell.strip() for cell in record):
            continue
        cells = tuple(record[i].strip() if i < len(record) else "" for i in index)
        if not all(cells):
            n_incomplete += 1
        elif cells[0] in seen:
            n_repeated += 1
        else:
            seen.add(cells[0])
            rows.append(cells)
    skipped = {"rows with an empty or missing cell": n_incomplete, "repeated sentences": n_repeated,
               "incomplete last line": int(torn)}
    if not rows:
        raise ValueError(f"SKI file {path} has no complete rows")
    if n_incomplete or n_repeated:
        logger.warning("%s: skipped %d row(s) with an empty cell and %d repeated sentence(s)", path, n_incomplete,
                       n_repeated)
    return TrainExamples(columns=SKI_COLUMNS, rows=rows, source=str(path), skipped=skipped)


def join_ski(triplets: TrainExamples | str | os.PathLike,
             ski: TrainExamples | Mapping[str, str] | str | os.PathLike) -> TrainExamples:
    """Append the SKI of ``sent0`` to every row of an NLI file: ``sent0,sent1,hard_neg`` -> ``sent0,sent1,hard_neg,ski``
    (``sent0,sent1`` pairs -> ``sent0,sent1,ski``).

    ``triplets`` is a :func:`~fastprompt.data.read_pair_csv` result or its path; ``ski`` a :func:`read_ski_csv`
    result, its path, or a ``{sentence: ski}`` mapping. Rows whose ``sent0`` has no SKI are skipped and counted.
    """
    if not isinstance(triplets, TrainExamples):
        triplets = read_pair_csv(triplets)
    if isinstance(ski, (str, os.PathLike)):
        ski = read_ski_csv(ski)
    if isinstance(ski, TrainExamples):
        ski = dict(ski.rows)
    rows = [(*row, ski[row[0]]) for row in triplets.rows if row[0] in ski]
    n_missing = len(triplets.rows) - len(rows)
    if not rows:
        raise ValueError(f"no sentence of {triplets.source or 'the NLI rows'} has a SKI ({len(ski)} SKI rows; "
                         "generate them with: fastprompt generate-ski --input NLI.csv --column sent0 ...)")
    if n_missing:
        logger.warning("%s: %d of %d rows have no SKI for sent0 and are left out", triplets.source, n_missing,
                       len(triplets.rows))
    return TrainExamples(columns=(*triplets.columns, "ski"), rows=rows, source=triplets.source,
                         skipped={**triplets.skipped, "rows without SKI": n_missing})


def write_examples_csv(examples: TrainExamples, path: str | os.PathLike) -> None:
    """Write ``examples`` as a CSV with its columns as the header, atomically (e.g. a :func:`join_ski` result)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(examples.columns)
    writer.writerows(examples.rows)
    write_text_atomic(path, buf.getvalue())


def read_input_sentences(path: str | os.PathLike, column: str | None = None) -> tuple[list[str], int]:
    """The sentences to generate SKI for, and the number of blank entries skipped.

    A ``.csv`` file is read by its header, taking ``column`` (default ``sent0``, e.g. the premises of an NLI
    file); any other file is UTF-8 text with one sentence per line. Surrounding whitespace is stripped.
    """
    path = Path(path)
    if path.suffix.lower() == ".csv":
        column = column or "sent0"
        reader, header, _ = _csv_reader(path, "input file")
        if column not in header:
            raise ValueError(f"input CSV {path} has no column {column!r} (columns: {header}); choose one with --column")
        i = header.index(column)
        values = [record[i] if i < len(record) else "" for record in reader if record]
    else:
        if column:
            raise ValueError(f"--column applies to CSV input; {path} is read as text, one sentence per line")
        values = read_utf8_lines(path, what="input file")
        if values:
            values[0] = values[0].lstrip("\ufeff")
    sentences = [v.strip() for v in values]
    kept = [s for s in sentences if s]
    return kept, len(sentences) - len(kept)

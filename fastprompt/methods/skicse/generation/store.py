"""The files of a SKI generation run, appended to as answers arrive, so that a killed run loses nothing.

``FILE.csv``               ``sent0,ski``: one row per sentence whose answer was accepted (the training input)
``FILE.csv.rejected.csv``  ``sent0,answer,reason``: sentences whose every attempt was rejected, and why
``FILE.csv.meta.json``     the settings (compared on resume), counts and runs; rewritten atomically

Crash safety: every record is one physical line (sentences are input lines; answers have their whitespace
collapsed) appended with one ``write()`` of the complete line to an ``O_APPEND`` descriptor, so the kernel
holds every row a killed process had written. At worst the row being written when the process died is
torn: the next open cuts the file back to its last complete line. The data is also ``fsync``-ed at most
once a second and at the end (for a machine crash). A lock file stops two runs writing the same output.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastprompt.data.corpus import parse_csv
from fastprompt.data.ski.files import SKI_COLUMNS, meta_path
from fastprompt.io import drop_torn_tail, read_json, write_json_atomic
from fastprompt.messages import shown
from fastprompt.schema import check_json

logger = logging.getLogger(__name__)

OUTPUT_COLUMNS = SKI_COLUMNS
REJECTED_COLUMNS = ("sent0", "answer", "reason")
META_FORMAT = "fastprompt-ski-generation"
META_VERSION = 1
_SYNC_INTERVAL_S = 1.0


@dataclass
class SkiMeta:
    """The schema of ``FILE.csv.meta.json`` (:mod:`fastprompt.schema`): the keys a resumed run reads and extends."""

    format: str
    settings: dict[str, Any]
    format_version: int = META_VERSION
    runs: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    complete: bool = False


def rejected_path(path: str | os.PathLike) -> Path:
    return Path(f"{path}.rejected.csv")


def encode_row(row) -> bytes:
    """One CSV record as one ``\\n``-terminated line (ValueError if a field would span lines)."""
    if any("\n" in field for field in row):
        raise ValueError(f"a SKI record cannot contain a line break: {row!r}")
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(row)
    return buf.getvalue().encode("utf-8")


def read_records(path: Path, columns: tuple[str, ...]) -> list[list[str]]:
    """The records of a file this module wrote, after its header (ValueError naming the line if it is not one)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 (byte {e.start}); not a file written by generate-ski") from None
    lines = iter(parse_csv(text, path, hint="; not a file written by generate-ski"))
    header = next(lines, None)
    if header != list(columns):
        raise ValueError(f"{path}: expected the header {','.join(columns)}, found {shown(header)}; not a file written "
                         "by generate-ski (use --overwrite to replace it, or another --output)")
    records = []
    for n, record in enumerate(lines, start=2):  # every record is one physical line (encode_row)
        if len(record) != len(columns):
            raise ValueError(f"{path}:{n}: expected {len(columns)} fields, found {len(record)}")
        records.append(record)
    return records


class _AppendLog:
    """An append-only CSV file: a header, then one line per record, each written with one ``write()``."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        self.path, self.columns = path, columns
        self._fd: int | None = None
        self._last_sync = 0.0

    def open(self) -> list[list[str]]:
        """Open for appending (creating the file with its header) and return the complete records already there."""
        records = []
        if self.path.exists():
            dropped = drop_torn_tail(self.path)
            if dropped:
                logger.warning("%s: dropped an incomplete last line (%d bytes) left by an interrupted run",
                               self.path, dropped)
            if self.path.stat().st_size:
                records = read_records(self.path, self.columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if os.fstat(self._fd).st_size == 0:
            self._write(encode_row(self.columns))
        return records

    def append(self, row) -> None:
        self._write(encode_row(row))
        if time.monotonic() - self._last_sync >= _SYNC_INTERVAL_S:
            self.sync()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def sync(self) -> None:
        os.fsync(self._fd)
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is not None:
            self.sync()
            os.close(self._fd)
            self._fd = None


def _normalise(data):
    """JSON round trip, so settings compare equal to what a metadata file stores (tuples become lists)."""
    return json.loads(json.dumps(data))


class SkiStore:
    """The output of :func:`~.generate.generate_ski`: use ``with SkiStore(path).open(...) as store``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.rejected_path = rejected_path(path)
        self.meta_path = meta_path(path)
        self.lock_path = self.path.parent / f".{self.path.name}.lock"
        self._accepted = _AppendLog(self.path, OUTPUT_COLUMNS)
        self._rejected = _AppendLog(self.rejected_path, REJECTED_COLUMNS)
        self._lock_fd: int | None = None
        self.meta: dict = {}
        #: sentence -> "accepted" or the rejection reason, for every sentence already in the files
        self.done: dict[str, str] = {}

    # ---------------------------------------------------------------------------------------- open
    def open(self, settings: dict, info: dict, *, overwrite: bool = False) -> SkiStore:
        """Lock the output, check or record ``settings`` and load what earlier runs wrote.

        ``overwrite`` deletes earlier output; otherwise output written with other ``settings`` is refused.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            files = (self.path, self.rejected_path, self.meta_path)
            if overwrite:
                for f in files:
                    f.unlink(missing_ok=True)
            settings = _normalise(settings)
            if any(f.exists() for f in files):
                self.meta = self._check_settings(settings)
            else:
                self.meta = {"format": META_FORMAT, "format_version": META_VERSION, "settings": settings, "runs": []}
            self.meta.update(columns=list(OUTPUT_COLUMNS), rejected_file=self.rejected_path.name,
                             rejected_columns=list(REJECTED_COLUMNS), info=_normalise(info), complete=False)
            for sentence, _ in self._accepted.open():
                self.done.setdefault(sentence, "accepted")
            for sentence, _, reason in self._rejected.open():
                self.done.setdefault(sentence, reason)
            self.meta["counts"] = self.counts()
            self.write_meta()
        except BaseException:
            self.close()
            raise
        return self

    def _lock(self) -> None:
        self._lock_fd = os.open(self.lock_path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, as for any tool writing a file
            return
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise ValueError(f"another generate-ski run is writing {self.path} (lock {self.lock_path})") from None

    def _check_settings(self, settings: dict) -> dict:
        if not self.meta_path.exists():
            raise ValueError(f"{self.path} exists without its metadata {self.meta_path.name}, so it cannot be resumed "
                             "safely: use --overwrite to replace it, or another --output")
        meta = read_json(self.meta_path, what="SKI generation metadata")
        if meta.get("format") != META_FORMAT:
            raise ValueError(f"{self.meta_path} is not generate-ski metadata (format {shown(meta.get('format'))})")
        check_json(meta, SkiMeta, f"SKI generation metadata {self.meta_path}")
        old = meta.get("settings", {})
        diff = [f"{k}: {old.get(k)!r} before, {settings.get(k)!r} now"
                for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
        if diff:
            raise ValueError(f"{self.path} was generated with other settings ({'; '.join(diff)}); rerun with the "
                             "same settings to resume, --overwrite to start over, or choose another --output")
        return meta

    # -------------------------------------------------------------------------------------- write
    def accept(self, sentence: str, ski: str) -> None:
        self._accepted.append((sentence, ski))
        self.done[sentence] = "accepted"

    def reject(self, sentence: str, answer: str, reason: str) -> None:
        self._rejected.append((sentence, answer, reason))
        self.done[sentence] = reason

    def counts(self) -> dict:
        """``{"rows": accepted sentences, "rejected": {reason: sentences}}`` over all runs."""
        c = Counter(self.done.values())
        rows = c.pop("accepted", 0)
        return {"rows": rows, "rejected": dict(sorted(c.items()))}

    def write_meta(self) -> None:
        write_json_atomic(self.meta_path, self.meta)

    def finish(self, run: dict, complete: bool) -> None:
        """Record ``run`` (the statistics of this run), the counts and ``complete``; sync everything to disk."""
        self._accepted.sync()
        self._rejected.sync()
        self.meta["counts"] = self.counts()
        self.meta["complete"] = complete
        self.meta.setdefault("runs", []).append(_normalise(run))
        self.write_meta()

    def close(self) -> None:
        self._accepted.close()
        self._rejected.close()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                self.lock_path.unlink()
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SkiStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

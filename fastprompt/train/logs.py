"""Training logs: a CSV of metrics (appended; truncated atomically on resume), TensorBoard if installed, a text log."""
from __future__ import annotations

import csv
import io
import logging
import math
from pathlib import Path

from fastprompt.io import write_text_atomic
from fastprompt.train.collapse import SPREAD_STAT

logger = logging.getLogger(__name__)

#: Columns of every run; a method's statistics (``Method.log_columns()``) go between the two groups.
LEADING_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm")
TRAILING_COLUMNS = ("skipped", "tokens_per_s", "stsb_dev", "elapsed_s")


def csv_columns(method_columns: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The header of train_log.csv for a method that logs ``method_columns`` (then every run's ``emb_spread``:
    :mod:`fastprompt.train.collapse`)."""
    return LEADING_COLUMNS + tuple(method_columns) + (SPREAD_STAT,) + TRAILING_COLUMNS


class MetricsLog:
    """``<output_dir>/train_log.csv`` (one row per ``log_every`` steps and per evaluation) + TensorBoard.

    Rows are flushed as they are written, so a killed run keeps everything up to its last step. On resume
    the rows after the checkpoint's step are dropped: those steps are trained again. ``columns``: the header
    (default: :func:`csv_columns` of no method statistics); keys of a row outside it are not written.
    """

    def __init__(self, output_dir: str | Path, *, resume_step: int | None, tensorboard: bool,
                 columns: tuple[str, ...] | None = None):
        self.path = Path(output_dir) / "train_log.csv"
        self.columns = tuple(columns) if columns is not None else csv_columns()
        if resume_step is None or not self.path.is_file():
            write_text_atomic(self.path, _csv_text(self.columns, []))
        else:
            self._truncate_after(resume_step)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._csv = csv.DictWriter(self._file, self.columns, extrasaction="ignore")
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                logger.debug("tensorboard is not installed: logging to CSV only")
            else:
                self.tb = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=resume_step)

    def _truncate_after(self, step: int) -> None:
        # Rewritten atomically: a crash here leaves the whole previous log, never a truncated one.
        with open(self.path, newline="", encoding="utf-8") as f:
            rows = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= step]
        write_text_atomic(self.path, _csv_text(self.columns, rows))

    def write(self, row: dict) -> None:
        clean = {k: (f"{v:.6g}" if isinstance(v, float) and math.isfinite(v) else v) for k, v in row.items()}
        self._csv.writerow(clean)
        self._file.flush()
        if self.tb is not None:
            step = int(row["step"])
            for k, v in row.items():
                if k not in ("step", "epoch", "elapsed_s") and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(f"train/{k}" if k != "stsb_dev" else "eval/stsb_dev", v, step)

    def close(self) -> None:
        self._file.close()
        if self.tb is not None:
            self.tb.close()


def _csv_text(columns: tuple[str, ...], rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def add_file_handler(path: str | Path) -> logging.Handler:
    """Mirror the ``fastprompt`` loggers into ``path`` (appending, so a resumed run keeps the history)."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    root = logging.getLogger("fastprompt")
    root.addHandler(handler)
    handler._previous_level = root.level  # restored by remove_file_handler
    if root.getEffectiveLevel() > logging.INFO:
        root.setLevel(logging.INFO)  # the file gets INFO records (so does the console, during training)
    return handler


def remove_file_handler(handler: logging.Handler) -> None:
    root = logging.getLogger("fastprompt")
    root.removeHandler(handler)
    root.setLevel(getattr(handler, "_previous_level", root.level))
    handler.close()

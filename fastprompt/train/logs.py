"""What a run writes about itself: train_log.csv (appended; truncated atomically on resume) with TensorBoard if
installed, the text log, and the summary (``summary.json``, and what ``train()`` returns)."""
from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastprompt.io import write_text_atomic
from fastprompt.train.collapse import SPREAD_STAT

logger = logging.getLogger(__name__)

#: Columns of every run; a method's statistics (``Method.log_columns()``) go between the two groups.
LEADING_COLUMNS = ("step", "epoch", "loss", "lr", "grad_norm")
TRAILING_COLUMNS = ("skipped", "tokens_per_s", "stsb_dev", "elapsed_s")
#: With ``train_backbone`` or ``lora``: the backbone's (or its adapters') learning rate (their own AdamW group), after
#: ``lr`` (the prompt's and the pooler head's; the backbone's when nothing else trains).
BACKBONE_LR = "backbone_lr"


def csv_columns(method_columns: tuple[str, ...] = (), *, backbone_lr: bool = False) -> tuple[str, ...]:
    """The header of train_log.csv for a method that logs ``method_columns`` (then every run's ``emb_spread``:
    :mod:`fastprompt.train.collapse`); ``backbone_lr`` adds the backbone group's learning rate after ``lr``."""
    leading = LEADING_COLUMNS
    if backbone_lr:
        i = leading.index("lr") + 1
        leading = (*leading[:i], BACKBONE_LR, *leading[i:])
    return leading + tuple(method_columns) + (SPREAD_STAT,) + TRAILING_COLUMNS


def window_row(window: Sequence, *, step: int, epoch: int, lrs: Sequence[float], backbone_lr: bool,
               elapsed_s: float) -> dict[str, Any]:
    """The train_log.csv row of the steps in ``window`` (each a :class:`~fastprompt.train.trainer.StepOutput`):
    means over the finite ones. ``lrs``: the optimizer groups' learning rates (``lr`` is the first group's; with
    ``backbone_lr``, the backbone's group is the last)."""
    finite = [w for w in window if math.isfinite(w.loss)]
    seconds = max(1e-9, sum(w.seconds for w in window))
    row: dict[str, Any] = {"step": step, "epoch": epoch, "lr": lrs[0], "skipped": sum(w.skipped for w in window),
                           "elapsed_s": elapsed_s, "tokens_per_s": sum(w.tokens for w in window) / seconds}
    if backbone_lr:
        row[BACKBONE_LR] = lrs[-1]
    if finite:
        row["loss"] = float(np.mean([w.loss for w in finite]))
        norms = [w.grad_norm for w in finite if w.grad_norm is not None and math.isfinite(w.grad_norm)]
        if norms:
            row["grad_norm"] = float(np.mean(norms))
        # a statistic only some steps have (each dataset's loss, with train_files) is the mean over those steps
        for key in dict.fromkeys(k for w in finite for k in w.stats):
            row[key] = float(np.mean([w.stats[key] for w in finite if key in w.stats]))
    return row


def run_summary(status: str, state, *, total_steps: int, run_dir, config, test: dict | None,
                frozen: dict | None) -> dict[str, Any]:
    """What ``Trainer.train()`` returns and writes to ``summary.json``: how the run ended, its dev history and
    best step, the final test table (and the frozen baseline's, with the ``comparison`` of the two: its ``message``
    says which is better), where its files are (``report``: report.png, once drawn), and its flat config."""
    from fastprompt.train.evaluation import compare_with_frozen

    best = run_dir.best
    frozen_test = frozen is not None and frozen.get("test") is not None
    return {
        "status": status,
        "global_step": state.global_step,
        "total_steps": total_steps,
        "epoch": state.epoch,
        "best_stsb_dev": state.best_score,
        "best_step": state.best_step,
        "dev_history": state.dev_history,
        "test": test,
        "frozen_baseline": frozen,
        "comparison": (compare_with_frozen(test, frozen, config.encoder.model) if test and frozen_test else None),
        "report": None,
        "nonfinite_steps": state.nonfinite_total,
        "train_seconds": round(state.train_seconds, 2),
        "output_dir": str(run_dir.root),
        "best_checkpoint": str(best) if best.is_dir() else None,
        "last_checkpoint": str(run_dir.last),
        "log_csv": str(run_dir.log_csv),
        "config": config.to_dict(),
    }


class NullLog:
    """The metrics sink of the non-main processes (only the main process writes logs)."""

    def write(self, row):
        pass

    def close(self):
        pass


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

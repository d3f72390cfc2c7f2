"""``report.png``: one picture of a training run, drawn from its files.

Three panels: STS-B dev against the training step with the frozen model's score as a labelled line (its own
pooling, and the prompt's when that differs), the training loss, and the final seven-task test scores of the best
checkpoint beside the frozen model's. Everything comes from the run folder: ``summary.json`` (dev history, test
tables, frozen baseline, the comparison's sentence) and ``train_log.csv`` (the loss). The trainer draws it at the end
of every run with evaluation; ``fastprompt report RUN_DIR`` draws it again. matplotlib only, on its Agg canvas
(files, no display).
"""
from __future__ import annotations

import csv
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastprompt.eval.sts import TASK_TITLES
from fastprompt.io import atomic_file, read_json

REPORT_NAME = "report.png"
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
#: The largest run files read (a long run's train_log.csv is a few MB): anything bigger is not a run's.
MAX_SUMMARY_BYTES = 16 << 20
MAX_LOG_BYTES = 256 << 20

_PROMPT_COLOR, _FROZEN_COLOR, _SAME_COLOR = "tab:blue", "0.3", "tab:orange"


@dataclass
class FrozenEntry:
    """A frozen-model entry of ``summary.json``: its ``frozen_baseline`` and that one's ``same_pooling``."""

    pooler: str
    key: str | None = None
    template: str | None = None
    stsb_dev: float | None = None
    test: dict[str, float] | None = None


@dataclass
class FrozenBaselineEntry(FrozenEntry):
    same_pooling: FrozenEntry | None = None


@dataclass
class Comparison:
    message: str


@dataclass
class RunSummaryFile:
    """The schema of a run's ``summary.json`` (:mod:`fastprompt.schema`; written by
    :func:`fastprompt.train.logs.run_summary`): the keys the report and ``train --seeds`` read. ``dev_history`` holds
    ``[step, STS-B dev]`` pairs; ``test`` the final table (null when the run had none)."""

    dev_history: list[tuple[int, float]]
    test: dict[str, float] | None
    status: str | None = None
    global_step: int | None = None
    total_steps: int | None = None
    best_stsb_dev: float | None = None
    best_step: int | None = None
    test_matryoshka: dict[str, dict[str, float]] | None = None
    frozen_baseline: FrozenBaselineEntry | None = None
    comparison: Comparison | None = None
    output_dir: str | None = None
    config: dict[str, Any] | None = None


def _check_size(path: Path, limit: int, what: str) -> None:
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path} is {size} bytes, more than a run's {what} holds (at most {limit}): "
                         "not a fastprompt run file")


def read_run(run_dir: str | os.PathLike) -> tuple[dict[str, Any], list[tuple[int, float]]]:
    """A run folder's ``summary.json`` and its logged losses ``[(step, loss), ...]`` from ``train_log.csv``, with
    one-line errors for a missing folder or file and for a corrupt one."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise NotADirectoryError(f"{run_dir} is a file, not a run folder: give a training run's output_dir (the "
                                 "folder holding its summary.json and train_log.csv)")
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder not found: {run_dir}")
    path = run_dir / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no summary.json: not a fastprompt run folder, or its run has not "
                                "ended yet (a run writes summary.json when it ends or is interrupted)")
    _check_size(path, MAX_SUMMARY_BYTES, "summary.json")
    summary = read_json(path, "run summary")
    if "dev_history" not in summary or "test" not in summary:
        raise ValueError(f"{path} is not a fastprompt run summary (no dev_history or test)")
    from fastprompt.schema import check_json

    check_json(summary, RunSummaryFile, f"run summary {path}")  # each key the report reads, of its type
    return summary, read_losses(run_dir / "train_log.csv")


def read_losses(path: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every training row of a run's ``train_log.csv`` (evaluation rows have no loss)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path.parent} has no train_log.csv: not a fastprompt run folder")
    _check_size(path, MAX_LOG_BYTES, "train_log.csv")
    out = []
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or not {"step", "loss"} <= set(reader.fieldnames):
                raise ValueError(f"{path} has no step and loss columns: not a fastprompt train_log.csv")
            for line, row in enumerate(reader, start=2):
                if not row.get("loss"):
                    continue
                try:
                    out.append((int(row["step"]), float(row["loss"])))
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{line}: step {row.get('step')!r} or loss {row['loss']!r} is not a "
                                     "number") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text ({exc.reason})") from None
    return out


def write_report(run_dir: str | os.PathLike, *, output: str | os.PathLike | None = None) -> Path:
    """Draw the run's report into ``output`` (default ``<run_dir>/report.png``; .png, .pdf or .svg), atomically,
    from the run's files. Returns the path written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the run report needs matplotlib: pip install matplotlib (or fastprompt[plots])") from None
    output = Path(output) if output is not None else Path(run_dir) / REPORT_NAME
    if output.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(f"the report must end in {', '.join(PLOT_SUFFIXES)}, got {output.name!r}")
    summary, losses = read_run(run_dir)

    fig = Figure(figsize=(12, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 1.1))
    dev_ax, loss_ax, bar_ax = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    _draw_dev(dev_ax, summary)
    _draw_loss(loss_ax, losses, summary)
    _draw_tests(bar_ax, summary)
    fig.suptitle(_title(summary), fontsize=11)
    with atomic_file(output, "report") as tmp:
        fig.savefig(tmp)
    return output


def _frozen_entries(summary: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The frozen baselines with their labels: its own pooling first, then the prompt's (when they differ)."""
    frozen = summary.get("frozen_baseline")
    if not frozen:
        return []
    first = {"native": "its own", "run_pooling": "the prompt's; its own is not known"}.get(frozen.get("key"), "")
    out = [(frozen, f"frozen model, {frozen['pooler']} pooling ({first})")]
    same = frozen.get("same_pooling")
    if same:
        template = ", with the template" if same.get("template") else ""
        out.append((same, f"frozen model, {same['pooler']} pooling (the prompt's{template})"))
    return out


def _draw_dev(ax, summary: dict[str, Any]) -> None:
    history = [(int(s), float(v)) for s, v in summary["dev_history"]]
    ax.set_title("STS-B dev (model selection)", fontsize=10)
    ax.set_xlabel("training step")
    ax.set_ylabel("Spearman × 100")
    _step_axis(ax, summary, [s for s, _ in history])
    if history:
        steps, scores = zip(*history)
        ax.plot(steps, scores, "o-", color=_PROMPT_COLOR, label="trained prompt")
        best = summary.get("best_step")
        if best is not None and summary.get("best_stsb_dev") is not None:
            ax.plot([best], [summary["best_stsb_dev"]], "*", color=_PROMPT_COLOR, markersize=14,
                    label=f"best: {summary['best_stsb_dev']:.2f} at step {best} (the tested checkpoint)")
    for (entry, label), color, style in zip(_frozen_entries(summary), (_FROZEN_COLOR, _SAME_COLOR), ("--", ":")):
        if entry.get("stsb_dev") is not None:
            ax.axhline(entry["stsb_dev"], color=color, linestyle=style, linewidth=1.5,
                       label=f"{label}: {entry['stsb_dev']:.2f}")
    if not summary.get("frozen_baseline"):
        ax.text(0.02, 0.02, "frozen model not scored (frozen_baseline: false)", transform=ax.transAxes,
                fontsize=8, color="0.4")
    if not history:
        ax.text(0.5, 0.5, "no STS-B dev evaluation in this run", transform=ax.transAxes, ha="center", va="center")
    else:
        ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)


def _draw_loss(ax, losses: list[tuple[int, float]], summary: dict[str, Any]) -> None:
    ax.set_title("training loss", fontsize=10)
    ax.set_xlabel("training step")
    config = summary.get("config") or {}
    every = config.get("log_every")
    ax.set_ylabel("loss" + (f" (mean of {every} steps)" if every else ""))
    finite = [(s, v) for s, v in losses if math.isfinite(v)]
    if finite:
        steps, values = zip(*finite)
        ax.plot(steps, values, "o-" if len(steps) < 40 else "-", color="tab:red", linewidth=1.2, markersize=3)
        _step_axis(ax, summary, steps)
    else:
        ax.text(0.5, 0.5, "no training loss logged", transform=ax.transAxes, ha="center", va="center")
    ax.grid(alpha=0.3)


def _draw_tests(ax, summary: dict[str, Any]) -> None:
    test = summary.get("test")
    ax.set_ylabel("Spearman × 100")
    if not test:
        config = summary.get("config") or {}
        if summary.get("status") != "completed":
            why = f"status: {summary.get('status')}"
        elif "sts_dir" in config and config["sts_dir"] is None:
            why = "no sts_dir: the run was not evaluated"
        else:
            why = "final_eval off" if config.get("final_eval") is False else "no test table in summary.json"
        ax.set_title("STS test sets of the best checkpoint", fontsize=10)
        ax.text(0.5, 0.5, f"no final test evaluation ({why})", transform=ax.transAxes, ha="center", va="center")
        ax.set_xticks([])
        return
    tasks = list(test)
    series = [("trained prompt (best checkpoint)", test, _PROMPT_COLOR, None)]
    series += [(label, entry["test"], color, hatch) for (entry, label), color, hatch
               in zip(_frozen_entries(summary), (_FROZEN_COLOR, _SAME_COLOR), (None, "//")) if entry.get("test")]
    width = 0.8 / len(series)
    values = [v for _, scores, _, _ in series for v in scores.values()]
    for i, (label, scores, color, hatch) in enumerate(series):
        xs = [t + (i - (len(series) - 1) / 2) * width for t in range(len(tasks))]
        bars = ax.bar(xs, [scores.get(t, math.nan) for t in tasks], width, color=color, hatch=hatch,
                      edgecolor="white" if hatch is None else "0.4", label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2, rotation=90)
    # the bars' differences are a few points of ~80: the axis starts just below the lowest bar, and says so
    low = max(-100, math.floor(min(values) / 5) * 5 - 5)
    ax.set_ylim(low, min(100, max(values) + 6))
    ax.set_xticks(range(len(tasks)), [TASK_TITLES.get(t, t) for t in tasks])
    if tasks[-1] == "avg":  # the average is no task of its own
        ax.axvline(len(tasks) - 1.5, color="0.6", linewidth=0.8)
    ax.set_title(f"STS test sets: best checkpoint vs frozen model (the axis starts at {low:g})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", ncols=len(series))
    ax.grid(axis="y", alpha=0.3)


def _step_axis(ax, summary: dict[str, Any], steps) -> None:
    last = max(1, int(summary.get("total_steps") or 0), *steps)
    ax.set_xlim(0, last * 1.03)


def _title(summary: dict[str, Any]) -> str:
    config = summary.get("config") or {}
    model = Path(str(config.get("model", "?"))).name  # a folder's name, not its whole path
    head = (f"{Path(str(summary.get('output_dir', ''))).name}: {model}, {config.get('objective', '?')} prompt, "
            f"{summary.get('global_step')}/{summary.get('total_steps')} steps ({summary.get('status')})")
    comparison = summary.get("comparison")
    if comparison:
        head += "\n" + "\n".join(textwrap.wrap(comparison["message"], 140))
    return head

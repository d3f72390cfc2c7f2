"""One recipe over several seeds, and the papers' mean ± standard deviation table of their STS test results.

``fastprompt train --config R --seeds 1,2,3`` (or :func:`train_seeds`) trains the recipe once per seed, each run
in its own folder ``<output_dir>/seed-<N>/`` (a complete, resumable run: rerunning the command resumes an
interrupted seed from its ``last/`` and skips a seed whose run already completed with the same settings), then
writes ``<output_dir>/seeds.json`` and ``<output_dir>/seeds.md``: every seed's seven-task test row (its best
STS-B dev checkpoint) and, per task and for the average, the mean and the sample standard deviation (n - 1)
over the completed seeds, as DCPCSE (means over 10 runs) and PromptBERT (mean ± std over 10 seeds) report them.
The std of the average is the std of the seeds' averages.

The frozen base model does not depend on the seed: with ``frozen_baseline`` on, only the first seed's run scores
it, and the table shows it once.
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastprompt.eval.report import RunSummaryFile
from fastprompt.io import read_json, write_json_atomic, write_text_atomic
from fastprompt.messages import shown
from fastprompt.train.config import RunConfig, TrainConfig

logger = logging.getLogger(__name__)

#: The STS test columns of the table, in the papers' order, and their headers.
COLUMNS = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "avg")
TITLES = ("STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg.")
#: Keys that do not change what a seed's run computes: a completed run with other values of these is reused.
_NOT_RESULTS = ("resume", "overwrite_output_dir", "progress_bar", "tensorboard", "num_threads", "log_every",
                "frozen_baseline", "device", "check_memory")
JSON_NAME, MARKDOWN_NAME = "seeds.json", "seeds.md"
#: The largest seed (the ``seed`` key's bound).
MAX_SEED = RunConfig.__dataclass_fields__["seed"].metadata["le"]


def parse_seeds(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]``: distinct seeds in the ``seed`` key's range, in the given order (all checked
    here, before any seed trains)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds takes comma-separated integers (e.g. 1,2,3), got {shown(text)}") from None
    if not seeds:
        raise ValueError("--seeds names no seed (e.g. --seeds 1,2,3)")
    if len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds must be distinct non-negative integers, got {shown(text)}")
    if max(seeds) > MAX_SEED:
        raise ValueError(f"--seeds: {max(seeds)} is not a seed: a run's seed is in [0, {MAX_SEED}] (32 bits, which "
                         "every seeding library accepts)")
    return seeds


def seed_dir(output_dir: str | Path, seed: int) -> Path:
    return Path(output_dir) / f"seed-{seed}"


def seed_config(config: TrainConfig, seed: int, *, first: bool) -> TrainConfig:
    """The recipe for one seed: its own seed and run folder (the frozen baseline on the first seed only)."""
    keys = {**config.to_dict(), "seed": seed, "output_dir": str(seed_dir(config.run.output_dir, seed))}
    if not first:
        keys["frozen_baseline"] = False
    return TrainConfig.from_dict(keys, source=f"seed {seed}")


def check_seeds_config(config: TrainConfig) -> None:
    """The table is of the final STS test results: refuse a recipe that would produce none, before any training."""
    ev = config.evaluation
    if ev.sts_dir is None or not ev.final_eval:
        raise ValueError("--seeds reports the seeds' STS test results: set sts_dir (the SentEval STS folder) and "
                         "keep final_eval=true")


def _completed_summary(cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a completed run of exactly this seed's settings in its folder, else None (always None
    with ``resume: false``: the seed then starts over, as the trainer decides)."""
    path = Path(cfg.run.output_dir) / "summary.json"
    if not cfg.run.resume or not path.is_file():
        return None
    try:  # a truncated or hand-edited file: one line naming it and the key, not a traceback
        summary = read_json(path, "run summary", schema=RunSummaryFile)
    except ValueError as exc:
        raise ValueError(f"{exc}; delete it and rerun: seed {cfg.run.seed} then resumes from its last/ checkpoint "
                         "(or trains again)") from None
    if summary.get("status") != "completed" or not summary.get("test"):
        return None
    missing = [c for c in COLUMNS if c not in summary["test"]]
    if missing:
        raise ValueError(f"run summary {path}: key 'test' has no {', '.join(missing)} (a completed run's test table "
                         f"holds {', '.join(COLUMNS)}); delete it and rerun: seed {cfg.run.seed} then resumes from "
                         "its last/ checkpoint (or trains again)")
    now, before = cfg.to_dict(), summary.get("config", {})
    if any(before.get(k) != v for k, v in now.items() if k not in _NOT_RESULTS):
        return None  # other settings: the trainer decides (it resumes, or refuses another run's checkpoint)
    return summary


def train_seeds(config: TrainConfig, seeds: Sequence[int], *,
                run: Callable[[TrainConfig], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train ``config`` once per seed (see the module docstring); returns the table written to ``seeds.json``.

    ``run``: trains one seed's config and returns its summary (default: ``Trainer(cfg).train()``). A seed that
    diverges or collapses is recorded with its status and left out of the mean; an interrupted seed stops the
    loop (the next command resumes it)."""
    from fastprompt.train.distributed import init_distributed
    from fastprompt.train.trainer import Trainer, TrainingCollapsed, TrainingDiverged

    check_seeds_config(config)
    # every seed's config before any trains: a bad seed fails now, not after the others have trained
    configs = [seed_config(config, seed, first=i == 0) for i, seed in enumerate(seeds)]
    run = run or (lambda cfg: Trainer(cfg).train())
    # Under torchrun, one process group for every seed (a Trainer does not destroy a group it did not create).
    dist = init_distributed(config.run.device)
    root = Path(config.run.output_dir)
    runs: list[dict[str, Any]] = []
    try:
        for i, (seed, cfg) in enumerate(zip(seeds, configs)):
            summary = _completed_summary(cfg)
            if summary is not None:
                logger.info("seed %d: completed earlier in %s, reusing its summary", seed, cfg.run.output_dir)
            else:
                logger.info("seed %d (%d of %d): training in %s", seed, i + 1, len(seeds), cfg.run.output_dir)
                try:
                    summary = run(cfg)
                except TrainingDiverged as exc:  # TrainingCollapsed too: the other seeds are independent
                    logger.error("seed %d: %s", seed, exc)
                    summary = {"status": "collapsed" if isinstance(exc, TrainingCollapsed) else "diverged",
                               "error": str(exc)}
            runs.append(_run_row(seed, cfg, summary))
            if summary["status"] == "interrupted":
                break
    finally:
        if dist.owns_group:
            dist.shutdown()
    table = seeds_table(runs, seeds, config)
    if int(os.environ.get("RANK", "0")) == 0:
        root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(root / JSON_NAME, table)
        write_text_atomic(root / MARKDOWN_NAME, seeds_markdown(table))
        logger.info("seed table: %s and %s", root / MARKDOWN_NAME, root / JSON_NAME)
    return table


def _run_row(seed: int, cfg: TrainConfig, summary: dict[str, Any]) -> dict[str, Any]:
    test = summary.get("test") if summary.get("status") == "completed" else None
    return {"seed": seed, "output_dir": cfg.run.output_dir, "status": summary["status"],
            "best_stsb_dev": summary.get("best_stsb_dev"), "best_step": summary.get("best_step"),
            "test": {k: test[k] for k in COLUMNS} if test else None,
            "frozen_baseline": summary.get("frozen_baseline"), "error": summary.get("error")}


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (n - 1; None for one value)."""
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return mean, std


def seeds_table(runs: list[dict[str, Any]], seeds: Sequence[int], config: TrainConfig) -> dict[str, Any]:
    """The JSON table: every seed's row, and mean/std per column over the completed seeds."""
    done = [r for r in runs if r["test"] is not None]
    columns = (*COLUMNS, "stsb_dev")
    mean, std = {}, {}
    if done:
        for c in columns:
            values = [r["best_stsb_dev"] if c == "stsb_dev" else r["test"][c] for r in done]
            if all(v is not None for v in values):
                mean[c], std[c] = mean_std(values)
    frozen = next((r["frozen_baseline"] for r in runs if r["frozen_baseline"]), None)
    keys = config.to_dict()
    keys.pop("seed")
    return {"seeds": list(seeds), "completed": [r["seed"] for r in done],
            "not_completed": [s for s in seeds if s not in {r["seed"] for r in done}], "n": len(done),
            "std": "sample standard deviation (n - 1) over the completed seeds",
            "mean_over_seeds": mean, "std_over_seeds": std, "runs": runs,
            "frozen_baseline": frozen, "config": keys}


def _cell(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "—"
    return f"{mean:.2f}" if std is None else f"{mean:.2f} ± {std:.2f}"


def seeds_markdown(table: dict[str, Any]) -> str:
    """The Markdown of :func:`seeds_table`: one row per seed, the frozen model, and mean ± std."""
    head = "| | " + " | ".join(TITLES) + " | STS-B dev (step) |"
    lines = [head, "|" + "---|" * (len(TITLES) + 2)]
    frozen = table["frozen_baseline"]
    if frozen and frozen.get("test"):
        cells = [_cell(frozen["test"].get(c), None) for c in COLUMNS]
        lines.append(f"| frozen base model ({frozen['pooler']} pooling, no prompt) | " + " | ".join(cells)
                     + f" | {_cell(frozen.get('stsb_dev'), None)} |")
    for r in table["runs"]:
        if r["test"] is None:
            lines.append(f"| seed {r['seed']} | " + " | ".join(["—"] * len(TITLES)) + f" | {r['status']} |")
            continue
        dev = "—" if r["best_stsb_dev"] is None else f"{r['best_stsb_dev']:.2f} ({r['best_step']})"
        lines.append(f"| seed {r['seed']} | " + " | ".join(f"{r['test'][c]:.2f}" for c in COLUMNS) + f" | {dev} |")
    mean, std = table["mean_over_seeds"], table["std_over_seeds"]
    if table["n"]:
        cells = [_cell(mean.get(c), std.get(c)) for c in (*COLUMNS, "stsb_dev")]
        cells[len(COLUMNS) - 1] = f"**{cells[len(COLUMNS) - 1]}**"
        label = f"mean ± std ({table['n']} seeds)" if table["n"] > 1 else "mean (1 seed, no std)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    notes = ["", f"Seeds {', '.join(map(str, table['seeds']))}; each row is the seven-task STS test result (Spearman "
             "× 100) of that seed's best STS-B dev checkpoint; ± is the sample standard deviation (n − 1) over the "
             "completed seeds."]
    if table["not_completed"]:
        notes.append(f"Not completed (left out of the mean): seeds {', '.join(map(str, table['not_completed']))}.")
    return "\n".join(lines + notes) + "\n"

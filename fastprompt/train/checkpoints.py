"""A run's folder: where its checkpoints, logs and summary live, whether a new run may resume there, and the
restoration of everything ``last/`` holds.

``<output_dir>/last/`` is the resume point: the prompt checkpoint, the token terms' weights
(``method.safetensors``, when the method has any) and the training state (:mod:`fastprompt.train.state`).
``<output_dir>/best/`` is the prompt checkpoint of the best STS-B dev score. Both are written into a
temporary folder and renamed into place, so a killed run leaves either the old or the new checkpoint. A run
finds its resume point with :meth:`RunDirectory.resume_point_for` (refusing another run's checkpoint) and,
once built, puts it back in place with :meth:`RunDirectory.restore`.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file, save_file

from fastprompt.io import atomic_directory, recover_directory, write_json_atomic
from fastprompt.model.checkpoint import foreign_files, is_checkpoint
from fastprompt.schema import check_json
from fastprompt.train.config import RUN_IDENTITY_KEYS
from fastprompt.train.run_lock import LOCK_NAME
from fastprompt.train.state import (
    META_FILE,
    TENSORS_FILE,
    TrainerState,
    has_training_state,
    load_training_state,
    read_training_meta,
    save_training_state,
)

logger = logging.getLogger(__name__)

#: Keys that only say how to start, never what the run is.
_START_KEYS = ("resume", "overwrite_output_dir")
METHOD_FILE = "method.safetensors"
#: What a run writes at the top of its output_dir besides its checkpoints and the lock (fastprompt.train.run_lock).
RUN_FILES = ("config.yaml", "train_log.csv", "train.log", "summary.json", "report.png", "tensorboard")
#: The checkpoints of a run and what it writes into each beside the prompt checkpoint's own files.
CHECKPOINT_EXTRAS = {"last": (METHOD_FILE, META_FILE, TENSORS_FILE), "best": ("train_info.json",)}
#: Leftovers of an interrupted atomic write (fastprompt.io) or of the writability probe (preflight).
_TRANSIENT = re.compile(r"\.(?:(?:last|best|config\.yaml|train_log\.csv|summary\.json|report\.png)"
                        r"\.(?:old|tmp-\d+(?:\.\w+)?)|fastprompt-write-test-\d+)")


@dataclass
class DataFingerprint:
    """What a run trained on: its row count and a hash of every sentence (:func:`data_fingerprint`)."""

    rows: int
    sha256: str


@dataclass
class TrainerRecord:
    """The schema of ``trainer`` in ``last/training_state.json``: what :meth:`Trainer.save_last` records."""

    EXTRA: ClassVar[str] = "forbid"
    state: TrainerState
    config: dict[str, Any] = field(default_factory=dict)
    total_steps: int = 0
    data: DataFingerprint | None = None  # absent in checkpoints written before it was recorded


def data_fingerprint(examples) -> dict[str, Any]:
    """:func:`rows_fingerprint` of one dataset; of several (``train_files``), their total row count and a hash of
    their hashes in order."""
    if not isinstance(examples, (list, tuple)):
        return rows_fingerprint(examples)
    if len(examples) == 1:
        return rows_fingerprint(examples[0])
    parts = [rows_fingerprint(ex) for ex in examples]
    return {"rows": sum(p["rows"] for p in parts),
            "sha256": hashlib.sha256("\n".join(p["sha256"] for p in parts).encode()).hexdigest()}


def rows_fingerprint(examples) -> dict[str, Any]:
    """``{"rows": N, "sha256": hex}`` of a run's training rows: the text of every sentence, in order, hashed once
    after loading (the file itself is not read again). Measured: 105 MB of text (1M sentences) in 1.8 s on a
    2-core AMD EPYC under a load of 16, mostly the joins; SHA-256 runs on the CPU's SHA extensions. A run that
    resumes on data whose fingerprint differs would continue its batch order on other sentences; a path alone
    cannot tell."""
    h = hashlib.sha256()
    rows = examples.rows
    for start in range(0, len(rows), 4096):  # one join per chunk: the per-sentence work stays in C
        h.update("\x1e".join("\x1f".join(row) for row in rows[start:start + 4096]).encode("utf-8", "surrogatepass"))
        h.update(b"\x1d")
    return {"rows": len(rows), "sha256": h.hexdigest()}


class RunDirectory:
    """Paths of a run's files, and the checkpoint writes and resume checks on them."""

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir)
        self.last = self.root / "last"
        self.best = self.root / "best"
        self.log_csv = self.root / "train_log.csv"
        self.log_text = self.root / "train.log"
        self.summary = self.root / "summary.json"
        self.report = self.root / "report.png"
        self.config_yaml = self.root / "config.yaml"
        #: set by :meth:`resume_point`: a fresh start over a previous run, whose files :meth:`clear_previous` deletes
        self.replaces_previous = False

    def foreign_entries(self) -> list[str]:
        """The names in output_dir that no fastprompt run wrote there.

        ``last/`` and ``best/`` are a run's when they are prompt checkpoints holding only what a run writes into
        them; the other names a run writes (:data:`RUN_FILES`, leftovers of an interrupted write) only in a folder a
        run has used: one holding the run lock or such a checkpoint. So a user's own ``best/``, ``config.yaml`` or
        ``summary.json`` in a folder that is no run are foreign, as is anything else (a project's files)."""
        if not self.root.is_dir():
            return []
        names = sorted(os.listdir(self.root))
        own = {name for name, extras in CHECKPOINT_EXTRAS.items()
               if name in names and is_checkpoint(self.root / name) and not foreign_files(self.root / name, extras)}
        if own or LOCK_NAME in names:
            own |= {n for n in names if n == LOCK_NAME or n in RUN_FILES or _TRANSIENT.fullmatch(n)}
        return [n for n in names if n not in own]

    def check_target(self, overwrite: bool) -> None:
        """Refuse an output_dir holding anything a run did not write (a ValueError naming it), unless
        ``overwrite``: training would replace the user's files of the same names, or mix with them."""
        foreign = self.foreign_entries()
        if foreign and not overwrite:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise ValueError(f"output_dir {self.root} holds files that no fastprompt run wrote ({shown}); a run "
                             "writes best/, last/, config.yaml, train_log.csv, train.log, summary.json and report.png "
                             "there. Choose a new or empty output_dir, or set overwrite_output_dir=true to let the run "
                             "replace what has those names")

    def resume_point(self, *, resume: bool, overwrite: bool) -> Path | None:
        """``last`` when this run continues a previous one, None for a fresh start.

        A fresh start over a previous run needs ``overwrite``; without it an existing run is an error that says
        how to continue or start over. The previous run's files are not deleted here but by :meth:`clear_previous`,
        once the new run's setup (config, data, model) has succeeded: a fresh start that fails keeps them.
        """
        last = recover_directory(self.last)
        has_last = last.is_dir() and has_training_state(last)
        if has_last and resume:
            return last
        if has_last or (self.best.exists() and not resume):
            if not overwrite:
                raise ValueError(
                    f"{self.root} already holds a training run; set resume=true to continue it, "
                    "overwrite_output_dir=true to start over, or choose another output_dir")
            self.replaces_previous = True
        return None

    def clear_previous(self) -> None:
        """Delete the previous run's checkpoints, log and summary for a fresh start (see :meth:`resume_point`)."""
        if not self.replaces_previous:
            return
        for d in (self.last, self.best):
            shutil.rmtree(d, ignore_errors=True)
        for f in (self.log_csv, self.summary, self.report):
            f.unlink(missing_ok=True)
        self.replaces_previous = False

    def resume_point_for(self, config) -> Path | None:
        """:meth:`resume_point` for a :class:`~fastprompt.train.config.TrainConfig`, and the checks that a
        resumed checkpoint belongs to this run (same identity keys, same full/prompt-only mode)."""
        from fastprompt.train.backbone import check_resume_mode

        resume_dir = self.resume_point(resume=config.run.resume, overwrite=config.run.overwrite_output_dir)
        if resume_dir is not None:
            check_resume_mode(resume_dir, config)
            self.check_same_run(resume_dir, config.to_dict())
        return resume_dir

    @staticmethod
    def restore(resume_dir: Path, *, method, optimizer, scheduler, scaler, total_steps: int,
                encoder=None) -> TrainerState:
        """Put everything ``resume_dir`` holds back in place, in the objects of a freshly built run, and return
        the trainer's counters: the token terms' weights, the optimizer, schedule, scaler and RNG states, and,
        when ``encoder`` is given (one not built from ``resume_dir``), its prompt (and trained backbone). Warns
        when the schedule's length (``total_steps``) changed since the checkpoint was written."""
        if encoder is not None:
            from fastprompt.model.checkpoint import load_checkpoint_weights, read_checkpoint_config

            load_checkpoint_weights(encoder, resume_dir, read_checkpoint_config(resume_dir))
        RunDirectory.load_method(method, resume_dir)
        saved = load_training_state(resume_dir, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        check_json(saved, TrainerRecord, f"training state {resume_dir / META_FILE}", "trainer")
        state = TrainerState(**saved["state"])
        logger.info("resumed from %s at step %d (epoch %d, batch %d)", resume_dir, state.global_step, state.epoch,
                    state.batch_in_epoch)
        _warn_if_schedule_moved(scheduler, total_steps)
        return state

    @staticmethod
    def check_same_run(resume_dir: Path, config: dict[str, Any]) -> None:
        """Refuse a checkpoint written with another run identity (flat config dicts, old ones included)."""
        meta = read_training_meta(resume_dir)
        before = check_json(meta["trainer"], TrainerRecord, f"training state {resume_dir / META_FILE}", "trainer")
        before = before.get("config", {})
        changed = [k for k in RUN_IDENTITY_KEYS if k in before and before[k] != config.get(k)]
        if changed:
            diffs = ", ".join(f"{k}: {before[k]!r} -> {config.get(k)!r}" for k in changed)
            raise ValueError(f"{resume_dir} was written by a run with a different configuration ({diffs}); "
                             "use another output_dir, or resume=false overwrite_output_dir=true to start over")
        other = [k for k in config if k in before and before[k] != config[k] and k not in _START_KEYS]
        if other:
            logger.warning("resuming with changed settings: %s", ", ".join(f"{k}={config[k]!r}" for k in other))

    @staticmethod
    def check_same_data(resume_dir: Path, fingerprint: dict[str, Any], source: str) -> None:
        """Refuse to resume on training rows other than the checkpoint's (:func:`data_fingerprint`; a checkpoint
        written before fingerprints were recorded is not checked)."""
        before = read_training_meta(resume_dir)["trainer"].get("data")
        if before is not None and before != fingerprint:
            raise ValueError(f"{resume_dir} was trained on other data than {source or 'the training rows'} holds now "
                             f"({before['rows']} rows then, {fingerprint['rows']} now; their content differs): "
                             "resuming would continue on other sentences; use another output_dir, or resume=false "
                             "overwrite_output_dir=true to start over")

    def save_last(self, encoder, method, *, optimizer, scheduler, scaler, trainer: dict[str, Any]) -> Path:
        """Write ``last/``: everything needed to continue the run exactly."""
        with atomic_directory(self.last) as tmp:
            encoder.save(tmp)
            state = {k: v.detach().contiguous().cpu() for k, v in method.resume_state().items()}
            if state:
                save_file(state, str(tmp / METHOD_FILE))
            save_training_state(tmp, optimizer=optimizer, scheduler=scheduler, scaler=scaler, trainer=trainer)
        return self.last

    @staticmethod
    def load_method(method, resume_dir: Path) -> None:
        """Restore the token terms' weights saved in ``resume_dir`` (nothing to do for a method without any)."""
        expected = method.resume_state()
        path = resume_dir / METHOD_FILE
        if not expected and not path.is_file():
            return
        if not path.is_file():
            raise ValueError(f"{resume_dir} has no {METHOD_FILE}: it was written by a run without the token terms "
                             f"{[t.name for t in method.terms]}; use another output_dir to train with them")
        saved = load_file(str(path))
        if set(saved) != set(expected):
            raise ValueError(f"{path} holds weights {sorted(saved)}, the method has {sorted(expected)}: "
                             "it was written by a run with other token terms")
        method.load_state_dict(saved, strict=False)  # the frozen parameters are not saved (resume_state)

    def save_best(self, encoder, info: dict[str, Any]) -> Path:
        """Write ``best/``: the prompt checkpoint and ``train_info.json`` (step, score, config)."""
        with atomic_directory(self.best) as tmp:
            encoder.save(tmp)
            write_json_atomic(tmp / "train_info.json", info)
        return self.best

    def write_summary(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.summary, summary)


def _warn_if_schedule_moved(scheduler, total_steps: int) -> None:
    """The learning-rate schedule is a function of the total step count: resuming with another max_steps or
    epochs moves it, and the next step's rate would jump (up, when the run was lengthened) silently."""
    saved = scheduler.get_last_lr()  # the rates last/ was saved with
    now = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    if any(abs(a - b) > 1e-6 * max(abs(a), abs(b), 1e-30) for a, b in zip(saved, now)):
        logger.warning("the learning-rate schedule now spans %d steps: at step %d the learning rate becomes "
                       "%.3g (it was %.3g when the checkpoint was saved); the change of max_steps or epochs "
                       "stretches the decay from here on", total_steps, scheduler.last_epoch, now[0], saved[0])

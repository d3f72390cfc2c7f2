"""Prompt checkpoints: ``prompt.safetensors`` (the trainable tensors) + ``fastprompt_config.json``.

Only safetensors and JSON are ever read. A checkpoint names its base model and records the backbone's
shape, so loading onto a different backbone fails with a message instead of a shape error deep inside.

A fully fine-tuned encoder (:meth:`PromptEncoder.train_backbone`) also writes its backbone and tokenizer in the
Hugging Face layout into the same folder (``config.json``, ``model.safetensors``, tokenizer files), so
``transformers.AutoModel.from_pretrained(checkpoint_dir)`` loads the backbone; ``backbone_weights: true`` in the
config says so. The whole folder is written atomically.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from fastprompt.io import atomic_directory, read_json, recover_directory, write_json_atomic
from fastprompt.messages import shown
from fastprompt.schema import check_json

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
    backbone_weights: bool = False
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
        "backbone_weights": bool(encoder.backbone_trained),
    }
    tensors = {k: v.detach().contiguous().cpu() for k, v in encoder.prompt_state_dict().items()}
    with atomic_directory(checkpoint_dir) as tmp:
        if encoder.backbone_trained:
            encoder.backbone.save_pretrained(tmp, safe_serialization=True)
            encoder.tokenizer.save_pretrained(tmp)
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": FORMAT})
        # what this save wrote: a later save may replace exactly these, and refuses a folder with anything else
        config["files"] = sorted([p.name for p in tmp.iterdir()] + [CONFIG_NAME])
        write_json_atomic(tmp / CONFIG_NAME, config)
    return Path(checkpoint_dir)


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
    encoder.load_state_dict(tensors, strict=False)

"""LoRA on the backbone (``lora: true``): PEFT's low-rank adapters injected into the backbone's linear layers, in
PEFT's own checkpoint layout.

:func:`add_lora` injects the adapters with PEFT (``LoraConfig`` + ``inject_adapter_in_model``) into the backbone
module itself, so the backbone keeps its class and every fastprompt path runs unchanged: the prefix attention
function, packed batches, the pooled-rows last layer and the fused dropout + add + LayerNorm all call the
projections as modules, and a LoRA layer is a module computing ``W x + (alpha / r) B A dropout(x)``. Only the
adapters' ``lora_A``/``lora_B`` require grad. The targets are the short names PEFT matches by suffix (``query``
matches ``encoder.layer.3.attention.self.query``); only linear layers inside the backbone's list of layers are
adapted (BERT's unused ``pooler.dense`` is left out: it never takes part in a forward, so it would get no
gradient). Each model family's spec holds its default targets (``Family.lora_targets``: the attention projections
and, for the BERT layout, the feed-forward's).

Checkpoint layout (:func:`save_adapter`): ``adapter_config.json`` (``LoraConfig.save_pretrained``) and
``adapter_model.safetensors`` with PEFT's key names (``base_model.model.<module>.lora_A.weight``), what
``PeftModel.save_pretrained`` writes, so ``PeftModel.from_pretrained(AutoModel.from_pretrained(base), folder)``
loads it. :func:`merge_lora` folds the adapters into the weights (the sentence-transformers and ONNX exports).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of the adapter's keys in a saved file (PeftModel -> LoraModel -> the base model)
PEFT_PREFIX = "base_model.model."
ADAPTER_NAME = "default"

def default_targets(backbone) -> list[str]:
    """The default target modules of ``backbone``'s model family (:attr:`fastprompt.model.arch.Family.lora_targets`);
    ValueError for a family without defaults."""
    from .arch import FAMILIES, family_of

    model_type = getattr(backbone.config, "model_type", None)
    targets = family_of(model_type).lora_targets
    if not targets:
        raise ValueError(f"LoRA has no default target modules for model_type {model_type!r} (it has them for "
                         f"{', '.join(t for t, f in FAMILIES.items() if f.lora_targets)}); set lora_target_modules "
                         "to the names of its linear layers (e.g. [q_proj, v_proj])")
    return list(targets)


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a target given as a name: the module's full name, or its last components."""
    return name == target or name.endswith("." + target)


def resolve_targets(backbone, layers, targets: list[str] | None) -> tuple[list[str], list[str]]:
    """(targets, excluded): the target names (``targets``, or the family's defaults) and the full names of the
    linear layers they match outside the backbone's list of ``layers`` (left out). ValueError for a target that
    matches no linear layer inside them."""
    targets = list(targets) if targets else default_targets(backbone)
    inside = {id(m) for m in layers.modules()} if layers is not None else None
    linear = [(n, m) for n, m in backbone.named_modules() if isinstance(m, torch.nn.Linear)]
    excluded = sorted(n for n, m in linear if any(_matches(n, t) for t in targets)
                      and inside is not None and id(m) not in inside)
    missing = [t for t in targets if not any(_matches(n, t) and n not in excluded for n, _ in linear)]
    if missing:
        names = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})
        raise ValueError(f"lora_target_modules {missing} match no linear layer of {type(backbone).__name__}; its "
                         f"linear layers are named {', '.join(names)}")
    return targets, excluded


def add_lora(backbone, layers, *, rank: int, alpha: float, dropout: float, targets: list[str] | None = None,
             base_model: str | None = None):
    """Inject LoRA adapters into ``backbone`` in place (``layers``: its list of layers); returns their
    ``LoraConfig``. The adapters start as PEFT initialises them (``lora_A`` Kaiming-uniform from torch's generator,
    ``lora_B`` zero: the backbone's outputs are unchanged until the first step)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets, excluded = resolve_targets(backbone, layers, targets)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        exclude_modules=excluded or None, bias="none", base_model_name_or_path=base_model)
    inject_adapter_in_model(config, backbone, adapter_name=ADAPTER_NAME)
    for name, p in backbone.named_parameters():  # PEFT marks the adapters trainable, everything else frozen
        p.requires_grad_("lora_" in name)
    return config


def adapter_state_dict(backbone) -> dict[str, torch.Tensor]:
    """The adapters' tensors under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    tag = f".{ADAPTER_NAME}."
    return {PEFT_PREFIX + k.replace(tag, "."): v for k, v in backbone.state_dict().items()
            if ".lora_" in k and tag in k}


def _own_key(saved_key: str) -> str:
    """A saved adapter key -> the backbone's state-dict key (``...query.lora_A.weight`` ->
    ``...query.lora_A.default.weight``)."""
    key = saved_key.removeprefix(PEFT_PREFIX)
    head, sep, tail = key.rpartition(".lora_")
    part, _, rest = tail.partition(".")
    return f"{head}{sep}{part}.{ADAPTER_NAME}.{rest}"


def save_adapter(backbone, config, folder: str | os.PathLike, base_model: str | None) -> None:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder`` (PEFT's layout)."""
    import dataclasses

    from safetensors.torch import save_file

    folder = Path(folder)
    dataclasses.replace(config, base_model_name_or_path=base_model).save_pretrained(str(folder))
    tensors = {k: v.detach().contiguous().cpu() for k, v in adapter_state_dict(backbone).items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def read_adapter_config(folder: str | os.PathLike):
    """The ``LoraConfig`` of a checkpoint folder's ``adapter_config.json``."""
    from peft import LoraConfig

    path = Path(folder) / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} says it holds LoRA adapters but has no {ADAPTER_CONFIG}")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path} is not a PEFT LoRA adapter config: {exc}") from exc
    if getattr(config, "peft_type", None) is None or str(config.peft_type.value) != "LORA":
        raise ValueError(f"{path} is not a PEFT LoRA adapter config (peft_type {config.peft_type!r})")
    return config


def load_adapter_weights(backbone, folder: str | os.PathLike) -> None:
    """The adapter tensors of ``folder`` into the adapters already injected into ``backbone``, in place."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} says it holds LoRA adapters but has no {ADAPTER_WEIGHTS}")
    try:
        saved = {_own_key(k): v for k, v in load_file(str(path)).items()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"LoRA weights {path} are corrupt or not a safetensors file: {exc}") from exc
    own = {k: v for k, v in backbone.state_dict().items() if ".lora_" in k}
    missing, unexpected = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
    if missing or unexpected:
        raise ValueError(f"LoRA weights {path} do not match the adapters its adapter_config.json describes "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    bad = [k for k, v in own.items() if saved[k].shape != v.shape]
    if bad:
        raise ValueError(f"LoRA weights {path} have wrong shapes: {bad[:3]}")
    nonfinite = [k for k in own if not torch.isfinite(saved[k]).all()]
    if nonfinite:
        raise ValueError(f"LoRA weights {path} hold NaN or infinite values (in {nonfinite[0]}): the run that wrote "
                         "them diverged; use an earlier checkpoint")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(saved[k])


def merge_lora(backbone) -> int:
    """Fold every LoRA adapter of ``backbone`` into its base layer's weight and put the base layer back in its
    place (PEFT's ``merge_and_unload``, in place); returns how many layers were merged."""
    from peft.tuners.lora import LoraLayer

    merged = 0
    for name, module in list(backbone.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
            parent = backbone.get_submodule(name.rpartition(".")[0]) if "." in name else backbone
            setattr(parent, name.rpartition(".")[2], module.get_base_layer())
            merged += 1
    for p in backbone.parameters():
        p.requires_grad_(False)
    if hasattr(backbone, "peft_config"):
        del backbone.peft_config
    return merged


def settings_of(config) -> dict:
    """What defines the adapters of a ``LoraConfig`` (compared when a run resumes or loads them)."""
    return {"rank": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "targets": sorted(config.target_modules)}

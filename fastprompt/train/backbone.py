"""Full fine-tuning (``train_backbone``) and LoRA (``lora``): the backbone's (or its adapters') own optimizer group,
the adapters' injection, and resume only in the same mode.

With ``train_backbone: true`` the backbone's weights are trained next to the prompt and the pooler head, with
their own learning rate and weight decay (``backbone_learning_rate``, ``backbone_weight_decay``; the linear
schedule scales every group alike); the backbone's biases and LayerNorm weights are never decayed (Hugging
Face's Trainer rule, which SimCSE and PromptBERT trained with). Checkpoints then hold the backbone in the Hugging
Face layout (:mod:`fastprompt.model.checkpoint`). The gradient cache, gradient checkpointing, autocast and
several processes need nothing more: they act on whatever parameters require grad.

With ``lora: true`` PEFT's adapters are injected into the backbone (:mod:`fastprompt.model.lora`) before the encoder
moves to its device; they form their own group (``lora_learning_rate``, ``lora_weight_decay``). A run resumed from
``last/`` gets them back from its checkpoint (``PromptEncoder.from_pretrained`` adds and loads them).
"""
from __future__ import annotations

from pathlib import Path

import torch


def no_decay_parameter_ids(module: torch.nn.Module) -> set[int]:
    """Parameters Hugging Face's Trainer (which SimCSE and PromptBERT fine-tune with) never decays: every bias
    and every LayerNorm weight (its rule: ``get_parameter_names(model, [nn.LayerNorm])`` minus the names that
    contain "bias")."""
    out = set()
    for sub in module.modules():
        for name, p in sub.named_parameters(recurse=False):
            if isinstance(sub, torch.nn.LayerNorm) or "bias" in name:
                out.add(id(p))
    return out


def add_lora(cfg, encoder) -> None:
    """Inject the LoRA adapters ``cfg`` asks for into ``encoder`` (nothing when it has them already: a run resumed
    from its checkpoint; ValueError when those are other adapters, or when the config asks for none)."""
    a = cfg.adapter
    if encoder.lora is None:
        if a.lora:
            encoder.add_lora(rank=a.lora_rank, alpha=a.lora_alpha, dropout=a.lora_dropout,
                             targets=a.lora_target_modules)
        return
    from fastprompt.model.lora import settings_of

    if not a.lora:
        raise ValueError("the encoder holds LoRA adapters but the config has lora: false; set lora: true to train "
                         "them, or start from an encoder without adapters")
    have = settings_of(encoder.lora)
    want = {"rank": a.lora_rank, "alpha": a.lora_alpha, "dropout": a.lora_dropout,
            "targets": sorted(a.lora_target_modules) if a.lora_target_modules else have["targets"]}
    if have != want:
        raise ValueError(f"the encoder's LoRA adapters ({have}) are not the ones the config asks for ({want})")


def optimizer_groups(cfg, params: list[torch.nn.Parameter], encoder=None) -> list[dict]:
    """AdamW parameter groups: the backbone's weights (when trained) apart from the rest, each with its own
    learning rate and weight decay; the backbone's biases and LayerNorm weights in a group of their own with no
    weight decay, as Hugging Face's Trainer does for SimCSE's and PromptBERT's fine-tuning. LoRA's adapters form
    one group (``lora_learning_rate``, ``lora_weight_decay``), after the rest."""
    if encoder is not None and encoder.lora is not None:
        adapters = {id(p) for n, p in encoder.backbone.named_parameters() if "lora_" in n}
        rest = [p for p in params if id(p) not in adapters]
        groups = [{"params": rest}] if rest else []
        return groups + [{"params": [p for p in params if id(p) in adapters], "lr": cfg.adapter.lora_learning_rate,
                          "weight_decay": cfg.adapter.lora_weight_decay}]
    if encoder is None or not cfg.backbone.train_backbone:
        return [{"params": params}]
    in_backbone = {id(p) for p in encoder.backbone.parameters()}
    no_decay = no_decay_parameter_ids(encoder.backbone)
    backbone = [p for p in params if id(p) in in_backbone and id(p) not in no_decay]
    exempt = [p for p in params if id(p) in in_backbone and id(p) in no_decay]
    rest = [p for p in params if id(p) not in in_backbone]
    lr = cfg.backbone.backbone_learning_rate
    groups = [{"params": rest}] if rest else []
    groups.append({"params": backbone, "lr": lr, "weight_decay": cfg.backbone.backbone_weight_decay})
    if exempt:
        groups.append({"params": exempt, "lr": lr, "weight_decay": 0.0})
    return groups


def check_resume_mode(resume_dir: Path, cfg) -> None:
    """Refuse to resume a prompt-only run as a full fine-tuning or LoRA one, or the reverse."""
    from fastprompt.model.checkpoint import holds_backbone_weights, holds_lora, read_checkpoint_config

    saved_config = read_checkpoint_config(resume_dir)
    if holds_lora(saved_config) != cfg.adapter.lora:
        was = "LoRA (lora=true)" if holds_lora(saved_config) else "no-LoRA (lora=false)"
        raise ValueError(f"{resume_dir} was written by a {was} run and cannot be resumed with "
                         f"lora={str(cfg.adapter.lora).lower()}; use another output_dir, or resume=false "
                         "overwrite_output_dir=true to start over")
    saved = holds_backbone_weights(saved_config)
    wanted = cfg.backbone.train_backbone
    if saved != wanted:
        was = "full fine-tuning (train_backbone=true)" if saved else "prompt-only (train_backbone=false)"
        raise ValueError(f"{resume_dir} was written by a {was} run and cannot be resumed with "
                         f"train_backbone={str(wanted).lower()}; use another output_dir, or resume=false "
                         "overwrite_output_dir=true to start over")

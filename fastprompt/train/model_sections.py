"""The config sections for training the backbone: full fine-tuning and LoRA, and :func:`check_tuning`, what the
tuning modes may combine with.

Standard library only, like every section of :class:`~fastprompt.train.config.TrainConfig`. The training side is
:mod:`fastprompt.train.backbone` (optimizer groups, checkpoint mode checks). PromptBERT's template section, once
here, is :mod:`fastprompt.methods.promptbert.config` (re-exported for the old path).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.fields import Section, option
from fastprompt.methods.promptbert.config import MASK, SENTENCE, TemplateConfig

__all__ = ["MASK", "SENTENCE", "BackboneConfig", "LoraSection", "TemplateConfig", "check_tuning"]


@dataclass
class BackboneConfig(Section):
    """Full fine-tuning: the backbone trained next to the prompt, with its own learning rate and decay."""

    train_backbone: bool = option(False, "train the backbone's weights too (full fine-tuning; checkpoints then "
                                  "hold the backbone in the Hugging Face layout)", identity=True)
    backbone_learning_rate: float = option(3e-5, "peak AdamW learning rate of the backbone's weights "
                                           "(train_backbone)", gt=0.0, identity=False)
    backbone_weight_decay: float = option(0.0, "AdamW weight decay of the backbone's weights (train_backbone)",
                                          ge=0.0, identity=False)


@dataclass
class LoraSection(Section):
    """LoRA: PEFT's low-rank adapters on the backbone's linear layers, trained with their own learning rate."""

    lora: bool = option(False, "train LoRA adapters on the backbone (PEFT; checkpoints then hold them in PEFT's "
                        "layout, adapter_model.safetensors + adapter_config.json); with prompt_type none, LoRA alone",
                        identity=True)
    lora_rank: int = option(8, "rank r of each adapter (lora)", ge=1, identity=True)
    lora_alpha: float = option(16.0, "scale alpha of the adapters: their update is multiplied by alpha / r (lora)",
                               gt=0.0, identity=True)
    lora_dropout: float = option(0.0, "dropout on the adapters' input (lora)", ge=0.0, lt=1.0, identity=True)
    lora_target_modules: list[str] | None = option(None, "names of the linear layers to adapt (PEFT's target_modules, "
                                                   "matched by suffix); null: the architecture family's attention "
                                                   "(and BERT-style feed-forward) projections (fastprompt.model.lora)",
                                                   identity=True)
    lora_learning_rate: float = option(5e-4, "peak AdamW learning rate of the LoRA adapters (lora)", gt=0.0,
                                       identity=False)
    lora_weight_decay: float = option(0.0, "AdamW weight decay of the LoRA adapters (lora)", ge=0.0, identity=False)

    def validate(self):
        super().validate()
        targets = self.lora_target_modules
        if targets is not None and (not isinstance(targets, list) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
            raise ValueError("lora_target_modules must list one or more module names (e.g. [query, value]), or be "
                             "null for the architecture family's defaults")
        return self


def check_tuning(config) -> None:
    """Refuse tuning settings that train nothing or contradict each other, before any model loads (ValueError)."""
    lora, full = config.adapter.lora, config.backbone.train_backbone
    prompt = config.prompt.prompt_type != "none"
    if lora and full:
        raise ValueError("lora: true and train_backbone: true both train the backbone: LoRA adapters next to fully "
                         "trained weights would train a second copy of the same weights; choose one of them")
    if not prompt and not (lora or full):
        raise ValueError("prompt_type: none trains no prompt, and the backbone is frozen: nothing would be tuned; "
                         "set lora: true (LoRA) or train_backbone: true (full fine-tuning), or choose a prompt_type")
    if not prompt and config.prompt.cls_prompt:
        raise ValueError("prompt_type: none with cls_prompt: true: the [CLS] prompt is a prompt; set prompt_type "
                         "(input) or cls_prompt: false")
    rtd = getattr(config, "rtd", None)  # D2CSE's replaced-token detection (fastprompt.methods.crtd)
    if rtd is not None and rtd.enabled and rtd.discriminator == "plain" and (lora or not prompt):
        raise ValueError("rtd_discriminator: plain runs the frozen backbone without the prompts (D2CSE's design a); "
                         "with lora: true or prompt_type: none there is no such frozen backbone (the adapters live "
                         "in the backbone, or there is no prompt to leave out); use rtd_discriminator: prompted")
    if not prompt and config.encoder.prefix_mode == "cache":
        raise ValueError("prefix_mode: cache hands a prefix to the backbone as a key/value cache, and prompt_type: "
                         "none has no prefix; leave prefix_mode at attention")

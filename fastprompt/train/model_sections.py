"""The config section for training the backbone (full fine-tuning).

Standard library only, like every section of :class:`~fastprompt.train.config.TrainConfig`. The training side is
:mod:`fastprompt.train.backbone` (optimizer groups, checkpoint mode checks). PromptBERT's template section, once
here, is :mod:`fastprompt.methods.promptbert.config` (re-exported for the old path).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.fields import Section, option
from fastprompt.methods.promptbert.config import MASK, SENTENCE, TemplateConfig

__all__ = ["MASK", "SENTENCE", "BackboneConfig", "TemplateConfig"]


@dataclass
class BackboneConfig(Section):
    """Full fine-tuning: the backbone trained next to the prompt, with its own learning rate and decay."""

    train_backbone: bool = option(False, "train the backbone's weights too (full fine-tuning; checkpoints then "
                                  "hold the backbone in the Hugging Face layout)", identity=True)
    backbone_learning_rate: float = option(3e-5, "peak AdamW learning rate of the backbone's weights "
                                           "(train_backbone)", gt=0.0, identity=False)
    backbone_weight_decay: float = option(0.0, "AdamW weight decay of the backbone's weights (train_backbone)",
                                          ge=0.0, identity=False)

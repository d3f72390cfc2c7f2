"""The ``rtd`` section of a training config (standard library only: it validates before torch loads)."""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.choices import RTD_AVERAGES, RTD_CONDITIONS, RTD_DISCRIMINATORS, RTD_SAMPLING
from fastprompt.fields import Section, option


@dataclass
class CRTDConfig(Section):
    """D2CSE's conditional replaced-token detection term (``rtd``); off while ``rtd_weight`` is 0."""

    weight: float = option(0.0, "initial weight λ of the replaced-token-detection term (D2CSE: 0.005); 0 = off",
                           ge=0.0, key="rtd_weight", identity=True)
    decay_rate: float = option(1.0, "λ decays as rtd_weight * rtd_decay_rate ** (step / rtd_decay_steps); "
                               "1 = constant (D2CSE)", gt=0.0, le=1.0, key="rtd_decay_rate", identity=True)
    decay_steps: int = option(1, "steps per decay of λ", ge=1, key="rtd_decay_steps", identity=True)
    masking_ratio: float = option(0.3, "share of each sentence's real, non-special tokens the generator replaces",
                                  gt=0.0, lt=1.0, key="rtd_masking_ratio", identity=True)
    generator: str = option("random", "the replacement generator: the path of a Hugging Face masked LM sharing "
                            "the backbone's vocabulary (D2CSE: distilbert-base-uncased), or 'random' (uniform "
                            "non-special tokens; for backbones with no such masked LM)", key="rtd_generator",
                            identity=True)
    sampling: str = option("sample", "masked-LM generator: sample from its distribution, or take its argmax "
                           "(DiffCSE's code)", choices=RTD_SAMPLING, key="rtd_sampling", identity=True)
    replacements_file: str | None = option(None, "replacements made ahead of training by `fastprompt "
                                           "make-replacements`; null: generate them on the fly",
                                           key="rtd_replacements_file", identity=True)
    discriminator: str = option("prompted", "discriminator: the backbone with the shared prompts (D2CSE design "
                                "d) or without prompts (design a)", choices=RTD_DISCRIMINATORS,
                                key="rtd_discriminator", identity=True)
    condition: str = option("after_head", "conditional input at position 0: the sentence embedding after or "
                            "before the pooler head, or none (design c)", choices=RTD_CONDITIONS,
                            key="rtd_condition", identity=True)
    average: str = option("tokens", "the RTD loss (summed over the real tokens but position 0) is divided by "
                          "their number (tokens) or by every position of the padded batch, padding and "
                          "position 0 included (positions: DiffCSE's mean)", choices=RTD_AVERAGES, key="rtd_average",
                          identity=True)

    @property
    def enabled(self) -> bool:
        return self.weight > 0

"""PromptBERT's config section: the template every sentence is wrapped in, the views' templates and template
denoising, and its rules against the other sections.

Standard library only, like every section of :class:`~fastprompt.train.config.TrainConfig`: a bad template
setting fails before torch loads. The training side is :mod:`fastprompt.methods.promptbert.training`.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.choices import TEMPLATE_POOLERS
from fastprompt.fields import Section, option
from fastprompt.messages import shown

SENTENCE, MASK = "[X]", "[MASK]"


def _check_template(key: str, text: str | None) -> None:
    if text is None:
        return
    if text.count(SENTENCE) != 1:
        raise ValueError(f"{key} must hold exactly one {SENTENCE} (where the sentence goes), got {shown(text)}")
    if text.count(MASK) > 1:
        raise ValueError(f"{key} may hold at most one {MASK}, got {shown(text)}")


@dataclass
class TemplateConfig(Section):
    """PromptBERT: the template every sentence is wrapped in, the views' templates and template denoising."""

    template: str | None = option(None, "the encoder's template, with one [X] (the sentence) and one [MASK]; "
                                  "evaluation and the first view use it; null: none (pooler mask/topk: "
                                  "PromptBERT's BERT template)", identity=True)
    second_template: str | None = option(None, "template of every view after the first (unsupervised: the "
                                         "positive; supervised: entailment and contradiction); null: the same "
                                         "template, so views differ by dropout only", identity=True)
    denoise: bool = option(False, "subtract each training view's template bias, the template fed alone with the "
                           "positions it has around the sentence (PromptBERT's template denoising; pooler mask, or "
                           "topk: its Table 9)", identity=True)
    eval_denoise: bool | None = option(None, "denoise in evaluation and in the saved checkpoint; null: as "
                                       "denoise (PromptBERT's unsupervised runs train denoised but evaluate "
                                       "without)", identity=True)
    topk: int = option(200, "k of the topk pooler (PromptBERT Eq. 3; its Table 9 uses the top 200 tokens)", ge=1,
                       identity=True)

    def validate(self) -> "TemplateConfig":
        super().validate()
        _check_template("template", self.template)
        _check_template("second_template", self.second_template)
        return self

    @property
    def resolved_eval_denoise(self) -> bool:
        return self.denoise if self.eval_denoise is None else self.eval_denoise


def uses_template(config) -> bool:
    """Whether a TrainConfig's sentences are wrapped in a template (set, or the mask/topk poolers' default)."""
    return config.templates.template is not None or config.encoder.pooler in TEMPLATE_POOLERS


def check_template_settings(config) -> None:
    """The rules between the template section and the others (``config``: a TrainConfig)."""
    tpl, pooler = config.templates, config.encoder.pooler
    if (tpl.denoise or tpl.resolved_eval_denoise) and pooler not in TEMPLATE_POOLERS:
        raise ValueError(f"denoise/eval_denoise subtract the template's [MASK] state: they need pooler=mask (or topk: "
                         f"PromptBERT's Table 9), got pooler={pooler}")
    if tpl.second_template is not None and not config.uses_template:
        raise ValueError("second_template wraps the other views in a template: set template (or pooler=mask/topk)")

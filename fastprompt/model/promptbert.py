"""PromptBERT's views: one batch of sentences, each view wrapped in its own template, each optionally denoised.

The unsupervised PromptBERT objective is InfoNCE between two views of a sentence that differ by template
(``This sentence of "[X]" means [MASK] .`` vs ``This sentence : "[X]" means [MASK] .``), each with its template
bias subtracted (:meth:`PromptEncoder.template_bias`). The paper's Table 8 ablations are the same call with
the same template twice (views then differ only by dropout) or with ``denoise=False``. Supervised PromptBERT
wraps (premise, entailment, contradiction) columns, the second template for the last two, as in its code.

Everything here is model-side: :func:`tokenize_views` builds the token ids (view-major rows, as
:class:`fastprompt.data.collate.Batch` lays out views), :func:`embed_views` runs them through the encoder in one
backbone pass and returns ``(n_views, B, hidden)`` for the contrastive loss.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .template import Template, wrap_batch

#: The templates of PromptBERT's unsupervised runs (its run.sh), per tokenizer family.
PROMPTBERT_TEMPLATES = {
    "bert": ('This sentence of "[X]" means [MASK] .', 'This sentence : "[X]" means [MASK] .'),
    "roberta": ("This sentence : ' [X] ' means [MASK].", "The sentence : ' [X] ' means [MASK]."),
}
_ROBERTA_FAMILY = ("roberta", "xlm-roberta", "camembert", "xlm-roberta-xl")


@dataclass
class PromptBERTConfig:
    """The model-side choices of the PromptBERT objective.

    Attributes:
        templates: one template per view; ``None``: the pair from :data:`PROMPTBERT_TEMPLATES` for the
            backbone's family. Give the same template twice for the "same template + dropout" ablation.
        denoise: subtract each view's template bias (the paper's default); ``False`` for the ablation.
    """

    templates: tuple[str, ...] | None = None
    denoise: bool = True

    def __post_init__(self):
        if self.templates is not None:
            if isinstance(self.templates, str) or len(self.templates) < 2:
                raise ValueError(f"templates must list one template per view (at least two), got {self.templates!r}")
            self.templates = tuple(self.templates)


def default_templates(encoder) -> tuple[str, str]:
    """PromptBERT's two unsupervised templates for the encoder's backbone family."""
    family = "roberta" if getattr(encoder.backbone.config, "model_type", "") in _ROBERTA_FAMILY else "bert"
    return PROMPTBERT_TEMPLATES[family]


@dataclass
class TemplateViews:
    """Token ids of ``n_views`` views of ``batch_size`` sentences, view-major: rows ``[v*B, (v+1)*B)`` are view v."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    templates: tuple[Template, ...]
    batch_size: int

    @property
    def n_views(self) -> int:
        return len(self.templates)

    def to(self, device) -> "TemplateViews":
        return TemplateViews(self.input_ids.to(device), self.attention_mask.to(device), self.templates,
                             self.batch_size)


def tokenize_views(encoder, columns: Sequence[Sequence[str]], templates: Sequence[str | Template],
                   max_length: int | None = None) -> TemplateViews:
    """Wrap column ``v`` of sentences in ``templates[v]`` (unsupervised: the same sentences in every column).

    ``max_length`` follows the template rule (the sentence's own tokens; see :mod:`fastprompt.model.template`).
    """
    if len(columns) != len(templates):
        raise ValueError(f"{len(columns)} columns of sentences but {len(templates)} templates: one per view")
    sizes = {len(c) for c in columns}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"every view needs the same, non-zero number of sentences; got {sorted(sizes)}")
    tpls = tuple(encoder._resolve_template(t) for t in templates)
    if encoder.template_words is not None and any(t.text != encoder.template for t in tpls):
        raise ValueError("OptiPrompt vectors belong to the encoder's own template: every view must use it")
    limit = encoder.model_max_tokens()
    ids = [row for col, t in zip(columns, tpls) for row in wrap_batch(encoder.tokenizer, t, list(col), max_length,
                                                                      limit)]
    padded = encoder.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    return TemplateViews(padded["input_ids"], padded["attention_mask"], tpls, sizes.pop())


def embed_views(encoder, views: TemplateViews, denoise: bool = True) -> torch.Tensor:
    """``(n_views, B, hidden)`` sentence vectors: one backbone pass over every row, then each view pooled at its
    template's [MASK] and, with ``denoise``, minus its template bias (computed with gradient in training)."""
    hidden = encoder.hidden_states(views.input_ids, views.attention_mask)
    B, out = views.batch_size, []
    for v, tpl in enumerate(views.templates):
        rows = slice(v * B, (v + 1) * B)
        out.append(encoder.pool(hidden[rows], views.input_ids[rows], views.attention_mask[rows], template=tpl,
                                denoise=denoise))
    return torch.stack(out)

"""PromptBERT training: each view wrapped in its template, pooled at its [MASK], optionally denoised.

The unsupervised objective (PromptBERT section 5) contrasts two views of a sentence that differ by template, each
minus its template bias (``template`` + ``second_template`` + ``denoise``); its Table 8 ablations are the same
template twice (``second_template: null``: the views differ by dropout only) and two templates without
denoising (``denoise: false``). Supervised PromptBERT wraps the premise in the first template and the
entailment and contradiction in the second, as the paper's code does.

Rows of different templates meet in one micro-batch of the gradient cache (micro-batches are planned by
length over all rows), so each row carries its template's index (``Batch.template_index``) and
:class:`TemplateViewEmbedder` runs one backbone pass over the rows and pools each row at its own template's
[MASK]. The template bias is computed inside that call, with dropout and gradient, so the gradient cache replays
it exactly with the rest of the micro-batch.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from fastprompt.data import Batch, Collator


class TemplateViewEmbedder:
    """Model inputs of rows wrapped in ``templates`` -> pre-head sentence vectors (rows, H).

    ``template_index`` (rows,) names each row's template (all rows: the first when it is None); ``denoise``
    subtracts each row's template bias (the training setting, independent of the encoder's own ``denoise``,
    which is what evaluation and the checkpoint use).
    """

    def __init__(self, encoder, templates: Sequence[str], denoise: bool):
        self.encoder = encoder
        self.templates = tuple(encoder._resolve_template(t) for t in templates)
        self.denoise = bool(denoise)

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 token_type_ids: torch.Tensor | None = None, template_index: torch.Tensor | None = None):
        enc = self.encoder
        hidden = enc.hidden_states(input_ids, attention_mask, token_type_ids)
        if template_index is None:
            template_index = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        rows, vecs = [], []
        for k, tpl in enumerate(self.templates):
            r = (template_index == k).nonzero().squeeze(1)
            if r.numel():
                rows.append(r)
                vecs.append(enc.pool(hidden[r], input_ids[r], attention_mask[r], template=tpl, denoise=self.denoise,
                                     head=False))
        order = torch.cat(rows)
        if order.numel() != input_ids.shape[0]:
            raise ValueError(f"template_index names templates outside 0..{len(self.templates) - 1}")
        return torch.cat(vecs)[torch.argsort(order)]


class TemplateCollator(Collator):
    """A :class:`Collator` that wraps view ``v`` in ``templates[view_template[v]]`` and records it per row."""

    def __init__(self, encoder, templates: Sequence[str], view_template: Sequence[int], max_length: int, *,
                 columns: Sequence[str] | None, views: Sequence[str], pad_token_id: int, text_ids: bool = False):
        fns = [functools.partial(_tokenize, encoder, t) for t in templates]
        super().__init__(fns[0], max_length, columns=columns, views=views,
                         view_tokenize=[fns[i] for i in view_template], pad_token_id=pad_token_id, text_ids=text_ids)
        self.view_template = torch.tensor(list(view_template), dtype=torch.long)

    def __call__(self, rows) -> Batch:
        batch = super().__call__(rows)
        batch.template_index = self.view_template.repeat_interleave(batch.batch_size)
        return batch


def _tokenize(encoder, template: str, texts: list[str], max_length: int) -> dict:
    return encoder.tokenize(texts, max_length, template=template)


def view_templates(cfg, encoder, views: Sequence[str]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The run's distinct templates and each view's index into them: the first view gets the encoder's
    template, every other view ``second_template`` (the encoder's when null)."""
    first = encoder.template
    second = cfg.templates.second_template or first
    templates = (first,) if second == first else (first, second)
    return templates, tuple(0 if v == 0 else len(templates) - 1 for v in range(len(views)))


def check_token_budget(cfg, encoder, templates: Sequence[str]) -> None:
    """``max_tokens_per_micro_batch`` must hold the longest sequence: max_length sentence tokens plus the
    longest template (and the special tokens), since max_length counts the sentence's tokens only."""
    budget = cfg.large_batch.max_tokens_per_micro_batch
    if budget <= 0:
        return
    overhead = max(encoder._resolve_template(t).overhead for t in templates)
    longest = min(cfg.data.max_length + overhead, encoder.model_max_tokens())
    if budget < longest:
        raise ValueError(f"max_tokens_per_micro_batch={budget} is smaller than the longest sequence: with a "
                         f"template max_length={cfg.data.max_length} counts the sentence's tokens and the "
                         f"template adds {overhead}; set it >= {longest}")


def template_collator(cfg, encoder, columns: Sequence[str] | None, views: Sequence[str], *,
                      text_ids: bool = False) -> TemplateCollator:
    """The collator of a run whose sentences are wrapped in templates (checks the micro-batch token budget)."""
    templates, per_view = view_templates(cfg, encoder, views)
    check_token_budget(cfg, encoder, templates)
    pad = encoder.tokenizer.pad_token_id
    return TemplateCollator(encoder, templates, per_view, cfg.data.max_length, columns=columns, views=views,
                            pad_token_id=pad if pad is not None else 0, text_ids=text_ids)


def template_embedder(cfg, encoder, views: Sequence[str]) -> TemplateViewEmbedder:
    """The training embed function of such a run: each row pooled at its template, denoised per ``denoise``."""
    return TemplateViewEmbedder(encoder, view_templates(cfg, encoder, views)[0], cfg.templates.denoise)


def collator(cfg, encoder, columns: Sequence[str] | None, views: Sequence[str],
             text_ids: bool) -> TemplateCollator | None:
    """The method's collator hook: the template collator when the run wraps sentences in templates, else None."""
    return template_collator(cfg, encoder, columns, views, text_ids=text_ids) if cfg.uses_template else None


def embedder(cfg, encoder, views: Sequence[str]) -> TemplateViewEmbedder | None:
    """The method's training-forward hook: the template embedder when the run wraps sentences, else None."""
    return template_embedder(cfg, encoder, views) if cfg.uses_template else None

"""PromptBERT's model side: the encoder's templates (the [MASK] state, template denoising, the top-k head),
OptiPrompt's trainable template words, and the templates of PromptBERT's unsupervised runs.

- :class:`TemplateMixin` gives :class:`~fastprompt.model.PromptEncoder` its template settings (``template``,
  ``denoise``, ``topk``, ``template_words``) and :meth:`~TemplateMixin.template_bias`: the [MASK] state of the
  template fed alone, with the positions it has around a sentence, which denoising subtracts.
- :class:`TemplateWords` (OptiPrompt, ``optiprompt=True``): the words of the template become trainable vectors,
  initialised from their static token embeddings; the sentence and the [MASK] keep their embeddings.
- :data:`PROMPTBERT_TEMPLATES`: the two templates of PromptBERT's unsupervised runs per tokenizer family. The
  views of its objective (two templates, each denoised) are the method's: one API,
  :mod:`fastprompt.methods.promptbert.training` (``TemplateCollator``, ``TemplateViewEmbedder``).

How sentences are wrapped and tokenised is :mod:`fastprompt.model.template`.
"""
from __future__ import annotations

import torch
from torch import nn

from fastprompt.choices import TEMPLATE_POOLERS

from .pooling import topk_token_representation
from .template import DEFAULT_TEMPLATE, Template, parse_template


class TemplateMixin:
    """The template side of :class:`~fastprompt.model.PromptEncoder` (PromptBERT, ``docs/promptbert.md``):
    ``template`` wraps every sentence, ``pooler="mask"`` takes the template's [MASK] state, ``denoise`` subtracts
    the template bias, ``pooler="topk"`` is the top-k weighted token representation, ``optiprompt`` makes the
    template's words trainable."""

    def _init_templates(self, prompt_config, pooler: str, template: str | None, denoise: bool, topk: int,
                        mlm_head: nn.Module | None) -> None:
        if pooler in TEMPLATE_POOLERS and template is None:
            template = DEFAULT_TEMPLATE
        self.template = template
        self._template = parse_template(self.tokenizer, template, self._eos_id) if template is not None else None
        self.template_words = None
        if prompt_config is not None and prompt_config.optiprompt:
            if self._template is None:
                raise ValueError("optiprompt=True makes the template's words trainable: give a template "
                                 "(or pooler='mask', which defaults to PromptBERT's)")
            self.template_words = TemplateWords(self._template, self.backbone.get_input_embeddings().weight)
        if denoise and (pooler not in TEMPLATE_POOLERS or self._template is None
                        or self._template.mask_token_id is None):
            raise ValueError("denoise=True subtracts the template's [MASK] state: it needs pooler 'mask' or 'topk' "
                             "and a template with [MASK]")
        self.denoise = bool(denoise)
        if pooler == "topk":
            if mlm_head is None:
                raise ValueError("pooler 'topk' needs the backbone's MLM head: build the encoder with "
                                 "PromptEncoder.from_pretrained, which reads it from the checkpoint")
            vocab = self.backbone.config.vocab_size
            if not isinstance(topk, int) or not 1 <= topk <= vocab:
                raise ValueError(f"topk must be an integer in [1, vocab size {vocab}], got {topk!r}")
        self.topk = topk
        self.mlm_head = mlm_head.requires_grad_(False) if mlm_head is not None else None
        self._bias_cache: dict = {}
        self._bias_cache_version = None

    def _resolve_template(self, template: str | Template | None) -> Template | None:
        if template is None:
            return self._template
        if isinstance(template, Template):
            return template
        if self._template is not None and template == self._template.text:
            return self._template
        return parse_template(self.tokenizer, template, self._eos_id)

    def _denoise_and_topk(self, vec: torch.Tensor, tpl: Template | None, attention_mask: torch.Tensor,
                          denoise: bool | None) -> torch.Tensor:
        """The selected (and transformed) [MASK] state minus its template bias (``denoise``; ``None`` keeps the
        encoder's setting), then the top-k head of pooler ``topk``."""
        denoise = self.denoise if denoise is None else denoise
        if denoise:
            if self.pooler.pooler not in TEMPLATE_POOLERS or tpl is None:
                raise ValueError("denoising subtracts the template's [MASK] state: it needs pooler 'mask' or "
                                 "'topk' and a template")
            bias = self.template_bias(tpl, self.sentence_lengths(tpl, attention_mask))
            vec = vec - self.pooler.transform(bias).to(vec.dtype)
        if self.pooler.pooler == "topk":  # PromptBERT's Table 9: top-k of the (denoised) [MASK] state
            vec = topk_token_representation(vec, self.mlm_head, self.backbone.get_input_embeddings().weight,
                                            self.topk)
        return vec

    @staticmethod
    def _mask_positions(tpl: Template | None, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """(B,) index of the template's [MASK] in each right-padded row, found from the template's structure
        (a literal mask token inside a sentence cannot be taken for it)."""
        if tpl is None or tpl.mask_token_id is None or tpl.mask_token_id not in tpl.alone():
            return None
        index = tpl.mask_index()
        if index < tpl.sentence_start:
            return torch.full((attention_mask.shape[0],), index, device=attention_mask.device, dtype=torch.long)
        from_end = len(tpl.alone()) - index
        return attention_mask.sum(1).long() - from_end

    @staticmethod
    def sentence_lengths(tpl: Template, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) number of sentence tokens in each row of sequences built with ``tpl``."""
        lengths = attention_mask.sum(1).long() - tpl.overhead
        if bool((lengths < 0).any()):
            raise ValueError(f"rows are shorter than the template {tpl.text!r}: were they built with it?")
        return lengths

    def template_inputs(self, tpl: Template, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The template fed alone, one row per length L, with the positions it has around an L-token sentence
        (tokens after [X] shifted by L): ``(input_ids, positions)``, both (len(lengths), template tokens)."""
        ids = torch.tensor(tpl.alone(), device=lengths.device)
        T = ids.numel()
        positions = torch.arange(T, device=lengths.device).unsqueeze(0) + \
            (torch.arange(T, device=lengths.device) >= tpl.sentence_start).long().unsqueeze(0) * lengths.unsqueeze(1)
        return ids.unsqueeze(0).expand(len(lengths), -1), positions

    def template_bias(self, template: str | Template | None, lengths: torch.Tensor) -> torch.Tensor:
        """PromptBERT's template bias: the [MASK] state of the template alone, for each sentence length, (B, hidden).

        In training it is recomputed on every call (dropout and gradients as for the sentences, once per distinct
        length of the batch). In evaluation (``eval()`` and no autograd) it depends only on (template, length),
        the weights and the numerics it runs in, so it is cached per (template, length, device, weight dtype,
        autocast dtype or none) until a parameter changes: a bias computed under bf16 autocast is never reused
        in float32, nor the other way round.
        """
        tpl = self._resolve_template(template)
        if tpl is None:
            raise ValueError("template_bias needs a template")
        uniq, inverse = torch.unique(lengths, return_inverse=True)
        cached = not self.training and not torch.is_grad_enabled()
        if not cached:
            return self._bias_for(tpl, uniq)[inverse]
        version = tuple((id(p), p._version) for p in self.parameters())
        if version != self._bias_cache_version:
            self._bias_cache, self._bias_cache_version = {}, version
        device = self.device
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        key = (tpl.text, device, next(self.backbone.parameters()).dtype, autocast)
        store = self._bias_cache.setdefault(key, {})
        missing = [int(L) for L in uniq.tolist() if int(L) not in store]
        if missing:
            new = self._bias_for(tpl, torch.tensor(missing, device=lengths.device))
            store.update(zip(missing, new))
        return torch.stack([store[int(L)] for L in uniq.tolist()])[inverse]

    def _bias_for(self, tpl: Template, lengths: torch.Tensor) -> torch.Tensor:
        ids, positions = self.template_inputs(tpl, lengths)
        mask = torch.ones_like(ids)
        hidden = self.hidden_states(ids, mask, positions=positions)
        return hidden[:, tpl.mask_index()]

    def clear_template_cache(self) -> None:
        """Forget the cached template biases (they are also dropped whenever a parameter changes in place)."""
        self._bias_cache, self._bias_cache_version = {}, None


class TemplateWords(nn.Module):
    """OptiPrompt: one trainable vector per template word, initialised from its static token embedding.

    ``slots_before``/``slots_after`` are the words' indices inside the template's ``before`` and ``after``
    parts (see :meth:`~fastprompt.model.template.Template.word_slots`); :meth:`apply` finds them in each
    sequence from its length, so padding and sentence lengths never move them.
    """

    def __init__(self, template, word_embeddings: torch.Tensor):
        super().__init__()
        b, a = template.word_slots()
        if not b and not a:
            raise ValueError(f"OptiPrompt: template {template.text!r} has no words besides [X] and [MASK]")
        self.template = template
        ids = torch.tensor(template.word_ids(), dtype=torch.long)
        self.register_buffer("token_ids", ids, persistent=False)
        self.embedding = nn.Parameter(word_embeddings.detach()[ids.to(word_embeddings.device)].clone())
        start = len(template.lead)
        self._before = torch.tensor([start + i for i in b], dtype=torch.long)
        # index of each ``after`` word counted back from the end of the real tokens
        tail = len(template.after) + len(template.trail)
        self._after_from_end = torch.tensor([tail - i for i in a], dtype=torch.long)

    def positions(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, words) index of every template word in each (right-padded) sequence."""
        B, dev = attention_mask.shape[0], attention_mask.device
        lengths = attention_mask.sum(1, keepdim=True).long()
        before = self._before.to(dev).unsqueeze(0).expand(B, -1)
        after = lengths - self._after_from_end.to(dev).unsqueeze(0)
        return torch.cat([before, after], dim=1)

    def apply(self, embeds: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Replace the template words' embeddings by the trainable vectors (out of place, differentiable)."""
        pos = self.positions(attention_mask)
        found = input_ids.gather(1, pos.clamp(0, input_ids.shape[1] - 1))
        if not bool(((pos >= 0) & (found == self.token_ids.unsqueeze(0))).all()):
            raise ValueError(f"OptiPrompt: the inputs are not sequences of the template {self.template.text!r} "
                             "(tokenise them with this encoder's tokenize())")
        rows = torch.arange(embeds.shape[0], device=embeds.device).unsqueeze(1).expand_as(pos)
        values = self.embedding.to(embeds.dtype).unsqueeze(0).expand(embeds.shape[0], -1, -1)
        return embeds.index_put((rows, pos), values)


#: The templates of PromptBERT's unsupervised runs (its run.sh), per tokenizer family.
PROMPTBERT_TEMPLATES = {
    "bert": ('This sentence of "[X]" means [MASK] .', 'This sentence : "[X]" means [MASK] .'),
    "roberta": ("This sentence : ' [X] ' means [MASK].", "The sentence : ' [X] ' means [MASK]."),
}

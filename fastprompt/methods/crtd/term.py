"""D2CSE's conditional replaced-token detection (CRTD) as a token-level term.

The term (name ``rtd``: log columns ``loss_rtd``, ``w_rtd``) corrupts every row of the batch (each view: anchor
and positive, and the hard negative when the data has one) with a frozen generator
(:mod:`fastprompt.data.replacements`: on the fly, or read from a file made ahead of training), and a
**discriminator** reads the corrupted row with its position-0 ([CLS]/<s>) input replaced by the sentence
embedding ``h`` of the original row (DiffCSE's ``cls_input``: the output of the backbone's embedding layer at
position 0 is ``h``). A small trainable classifier (``Linear(hidden, 2)``, DiffCSE's ``electra_head``) predicts
replaced/original at every real token but position 0; the term is the cross-entropy **sum** over those tokens,
which the trainer divides by their number in the global batch (``average="tokens"``) or by the number of
positions of the padded batch (``average="positions"``: the count DiffCSE's ``CrossEntropyLoss`` means over;
DiffCSE also scores [CLS] and padding as "original", which this term leaves out, see ``docs/crtd.md``).
The gradient flows into ``h`` (the trainer carries it back into the sentence forwards and the pooler head) and,
with the shared discriminator, into the prompts.

D2CSE's designs (its Figure/Table of discriminator variants), as two settings:

- ``discriminator="prompted"``, ``condition="after_head"``: design (d), the paper's best: the discriminator is
  the same frozen backbone with the **shared** prompts; ``h`` is what the sentence objective sees;
- ``discriminator="plain"``: design (a): prompts on the sentence encoder only, the discriminator is the frozen
  backbone without prompts (only ``h`` and the classifier carry its gradient);
- ``condition="none"``: design (c): no conditional input (position 0 keeps its token), shared prompts;
- ``condition="before_head"``: the pooled vector before the pooler head (DiffCSE's ``--before_mlp``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fastprompt.choices import RTD_AVERAGES, RTD_CONDITIONS, RTD_DISCRIMINATORS, check_choice
from fastprompt.objectives.base import AFTER_HEAD, TokenTerm, WeightSchedule


@contextlib.contextmanager
def conditional_input(backbone: nn.Module, h: torch.Tensor | None):
    """While active, the backbone's embedding layer outputs ``h`` (rows, hidden) at position 0 (nothing when
    ``h`` is None): of each row, or in a packed batch at each sequence's first token."""
    if h is None:
        yield
        return
    embeddings = getattr(backbone, "embeddings", None)
    if not isinstance(embeddings, nn.Module):
        raise ValueError(f"{type(backbone).__name__} has no 'embeddings' module: the conditional input needs a "
                         "BERT-style backbone")

    state = {}

    def forward_state(module, args, kwargs):  # the prompted forward's state (its packed layout's offsets)
        state["now"] = kwargs.get("fastprompt_state")

    def hook(module, args, out):
        offsets = getattr(state.get("now"), "cu_seqlens", None)
        if offsets is None:
            return torch.cat([h.to(out.dtype).unsqueeze(1), out[:, 1:]], dim=1)
        return out[0].index_copy(0, offsets[:-1], h.to(out.dtype)).unsqueeze(0)

    handles = [backbone.register_forward_pre_hook(forward_state, with_kwargs=True),
               embeddings.register_forward_hook(hook)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class CRTDTerm(TokenTerm):
    """Conditional replaced-token detection (see the module docstring).

    replacer: a :class:`~fastprompt.data.replacements.ReplacementGenerator` (on the fly) or a
    :class:`~fastprompt.data.replacements.ReplacementTable` (a file made ahead of training).
    """

    def __init__(self, hidden_size: int, replacer, weight: WeightSchedule = WeightSchedule(0.005), *,
                 discriminator: str = "prompted", condition: str = AFTER_HEAD, average: str = "tokens",
                 name: str = "rtd"):
        check_choice("discriminator", discriminator, RTD_DISCRIMINATORS)
        check_choice("condition", condition, RTD_CONDITIONS)
        check_choice("average", average, RTD_AVERAGES)
        self.average = average
        self.sentence_embedding = None if condition == "none" else condition
        super().__init__(name, weight)
        self.replacer, self.discriminator, self.condition = replacer, discriminator, condition
        # PyTorch's default initialisation, as DiffCSE's code (train.py: ``model.electra_head =
        # torch.nn.Linear(768, 2)``, made after from_pretrained, so init_weights() never touches it); D2CSE
        # publishes no code
        self.classifier = nn.Linear(hidden_size, 2)

    def make_extras(self, batch, generator):
        if hasattr(self.replacer, "table"):
            corrupted, labels = self.replacer.corrupt(batch.input_ids, batch.attention_mask)
        else:
            corrupted, labels = self.replacer.corrupt(batch.input_ids, batch.attention_mask, generator)
        return {f"{self.name}_input_ids": corrupted, f"{self.name}_labels": labels}

    def num_targets(self, extras):
        labels = extras[f"{self.name}_labels"]
        if self.average == "positions":  # rows x padded length of the collated batch, as DiffCSE's mean
            return torch.tensor(labels.numel())
        return (labels != -100).sum()

    def forward(self, encoder, inputs, extras, h):
        ids, labels = extras[f"{self.name}_input_ids"], extras[f"{self.name}_labels"]
        mask, types = inputs["attention_mask"], inputs.get("token_type_ids")
        with conditional_input(encoder.backbone, None if self.condition == "none" else h):
            if self.discriminator == "prompted":
                hidden = encoder.hidden_states(ids, mask, types)
            else:
                hidden = encoder.backbone(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        targets = labels != -100
        logits = self.classifier(hidden[targets].float())
        return F.cross_entropy(logits, labels[targets], reduction="sum")


def build_crtd_term(cfg, encoder) -> CRTDTerm:
    """The term a training config's ``rtd`` section (:class:`~fastprompt.methods.crtd.config.CRTDConfig`)
    describes, for ``encoder`` (its tokenizer and hidden size; the generator runs on its device)."""
    from fastprompt.data.replacements import ReplacementTable, build_generator, check_replacement_settings

    if cfg.replacements_file is not None:
        replacer = ReplacementTable(cfg.replacements_file)
        check_replacement_settings(replacer.settings, cfg, getattr(encoder, "base_model", None),
                                   cfg.replacements_file)
    else:
        replacer = build_generator(cfg.generator, encoder.tokenizer, cfg.masking_ratio, cfg.sampling,
                                   encoder.device, trust_remote_code=getattr(encoder, "trust_remote_code", False))
    weight = WeightSchedule(cfg.weight, cfg.decay_rate, cfg.decay_steps)
    return CRTDTerm(encoder.hidden_size, replacer, weight, discriminator=cfg.discriminator, condition=cfg.condition,
                    average=cfg.average)

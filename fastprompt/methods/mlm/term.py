"""DCPCSE's auxiliary masked-language-model term: ``weight(step) * MLM loss`` through the prompted encoder.

BERT's masking recipe on every row of the batch (every view, as DCPCSE's collator does): each real token that
is not a special token is chosen with probability ``probability``; a chosen token is replaced by the mask token
(80%), by a uniformly random vocabulary id (10%) or kept (10%), and is predicted by the backbone's MLM head from
the prompted encoder's last hidden state. The prompts get the term's gradient. The head comes from the
checkpoint and, as in DCPCSE's code (which produced the paper's numbers), trains with the prompt at its
learning rate, its decoder an untied copy of the word embeddings (``train_head=True``,
:func:`fastprompt.model.mlm_head.trainable_mlm_head`); ``train_head=False`` keeps it frozen and tied.
``mlm_head: tied_new`` instead builds a new head tied to the word embeddings with a trainable transform, for
backbones saved without one. Vocabulary logits are computed only at the chosen positions: (targets, vocab),
never (rows, seq_len, vocab).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastprompt.choices import MLM_HEADS, check_choice
from fastprompt.data.collate import Batch
from fastprompt.objectives.base import TokenTerm, WeightSchedule

#: DCPCSE's weight schedule: 0.1 * 0.95 ** (step / 100) (its trainer's decay_rate and decay_steps).
DCPCSE_MLM_WEIGHT = WeightSchedule(0.1, 0.95, 100)
MLM_HEAD_HINT = ("the MLM term needs a checkpoint saved from a *ForMaskedLM model (e.g. bert-base-uncased, "
                 "roberta-base); for a backbone saved without an MLM head set mlm_head: tied_new (a new head tied "
                 "to the word embeddings, trained from scratch: not DCPCSE's setting), or do_mlm: false")


def mask_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, special_ids: torch.Tensor, *,
                mask_token_id: int, vocab_size: int, probability: float,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's 80/10/10 masking: (corrupted input ids, labels with -100 where a token was not chosen).

    Never chooses padding or a special token (``special_ids``). All draws come from ``generator``, over the
    whole (rows, seq_len) grid, so the result depends only on the generator's seed and the shape.
    """
    shape = input_ids.shape
    eligible = attention_mask.bool() & ~torch.isin(input_ids, special_ids)
    chosen = (torch.rand(shape, generator=generator) < probability) & eligible
    masked = (torch.rand(shape, generator=generator) < 0.8) & chosen
    randomised = (torch.rand(shape, generator=generator) < 0.5) & chosen & ~masked
    random_ids = torch.randint(vocab_size, shape, generator=generator)
    corrupted = torch.where(masked, torch.full_like(input_ids, mask_token_id), input_ids)
    corrupted = torch.where(randomised, random_ids, corrupted)
    labels = torch.where(chosen, input_ids, torch.full_like(input_ids, -100))
    return corrupted, labels


class MLMTerm(TokenTerm):
    """The MLM token term (name ``mlm``: extras ``mlm_input_ids``/``mlm_labels``, log columns ``loss_mlm``,
    ``w_mlm``).

    head: maps hidden states (..., hidden) to vocabulary logits (a ``BertOnlyMLMHead``/``RobertaLMHead``, see
    :func:`build_mlm_head`). special_ids: token ids never chosen (the tokenizer's special tokens).
    """

    sentence_embedding = None

    def __init__(self, head: nn.Module, *, mask_token_id: int, vocab_size: int, special_ids: list[int],
                 probability: float = 0.15, weight: WeightSchedule = DCPCSE_MLM_WEIGHT, name: str = "mlm"):
        super().__init__(name, weight)
        if not 0 < probability < 1:
            raise ValueError(f"mlm_probability must be in (0, 1), got {probability}")
        self.head = head
        self.mask_token_id, self.vocab_size, self.probability = int(mask_token_id), int(vocab_size), probability
        self.register_buffer("special_ids", torch.tensor(sorted(set(special_ids)), dtype=torch.long),
                             persistent=False)

    @classmethod
    def for_encoder(cls, encoder, head: str = "checkpoint", train_head: bool = True, **kwargs) -> "MLMTerm":
        """The term for a :class:`~fastprompt.model.PromptEncoder`: its tokenizer's mask and special tokens, and
        the head ``head`` and ``train_head`` name (see :func:`build_mlm_head`)."""
        tok = encoder.tokenizer
        if tok.mask_token_id is None:
            raise ValueError(f"the tokenizer of {encoder.base_model} has no mask token: the MLM term cannot mask")
        return cls(build_mlm_head(encoder, head, train_head), mask_token_id=tok.mask_token_id,
                   vocab_size=min(len(tok), encoder.backbone.config.vocab_size),
                   special_ids=list(tok.all_special_ids), **kwargs)

    def make_extras(self, batch: Batch, generator: torch.Generator) -> dict[str, torch.Tensor]:
        corrupted, labels = mask_tokens(batch.input_ids, batch.attention_mask, self.special_ids.cpu(),
                                        mask_token_id=self.mask_token_id, vocab_size=self.vocab_size,
                                        probability=self.probability, generator=generator)
        return {f"{self.name}_input_ids": corrupted, f"{self.name}_labels": labels}

    def num_targets(self, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        return (extras[f"{self.name}_labels"] != -100).sum()

    def forward(self, encoder, inputs: dict[str, torch.Tensor], extras: dict[str, torch.Tensor],
                h: torch.Tensor | None) -> torch.Tensor:
        labels = extras[f"{self.name}_labels"]
        targets = labels != -100
        hidden = encoder.hidden_states(extras[f"{self.name}_input_ids"], inputs["attention_mask"],
                                       inputs.get("token_type_ids"))
        logits = self.head(hidden[targets])  # (targets, vocab): only the chosen positions reach the decoder
        return F.cross_entropy(logits.float(), labels[targets], reduction="sum")


def build_mlm_head(encoder, head: str = "checkpoint", train: bool = True) -> nn.Module:
    """The MLM head of ``encoder``'s backbone: ``checkpoint`` (read from the model folder) trained as DCPCSE's
    code trains it (``train``: its own copy, decoder untied) or frozen (the encoder's own when its pooler
    already loaded it), or ``tied_new`` (see :func:`fastprompt.model.mlm_head.new_tied_mlm_head`; always
    trained)."""
    from fastprompt.model.mlm_head import load_mlm_head, new_tied_mlm_head, trainable_mlm_head
    from fastprompt.model.resolve import resolve_model_path

    check_choice("mlm_head", head, MLM_HEADS)
    if head == "tied_new":
        if not train:
            raise ValueError("mlm_head: tied_new is a new head: it must train (mlm_train_head: true)")
        return new_tied_mlm_head(encoder.backbone, trust_remote_code=getattr(encoder, "trust_remote_code", False))
    if not train and getattr(encoder, "mlm_head", None) is not None:
        return encoder.mlm_head
    if encoder.base_model is None:
        raise ValueError("the encoder does not know its model folder, so the MLM head cannot be read; "
                         + MLM_HEAD_HINT)
    loaded = load_mlm_head(resolve_model_path(encoder.base_model), encoder.backbone, hint=MLM_HEAD_HINT,
                           trust_remote_code=getattr(encoder, "trust_remote_code", False))
    return trainable_mlm_head(loaded) if train else loaded

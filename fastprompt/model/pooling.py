"""Poolers: how the last hidden states become one sentence vector, plus the optional training heads."""
from __future__ import annotations

import torch
from torch import nn

from fastprompt.choices import MLP_MODES, POOLERS, check_choice

__all__ = ["Pooler", "POOLERS", "MLP_MODES"]


class Pooler(nn.Module):
    """Pick the sentence vector and optionally apply a trainable head.

    pooler: "cls" ([CLS] state), "cls_before_pooler" ([CLS] state, never a head), "mean" (mean over real
    tokens), "mask" (state of the first [MASK] token: PromptBERT's template representation), "bn_mlp"
    ([CLS] state with D2CSE's BatchNorm MLP head).
    mlp: when the head is applied: "none", "train" (SimCSE's ``mlp_only_train``: training only) or "always".
    The head is SimCSE's Linear + Tanh for cls/mean/mask and Linear-BN-ReLU-Linear for bn_mlp.

    ``forward`` = :meth:`apply_head` of :meth:`pool`. Training calls the two apart: the encoder returns
    :meth:`pool`'s vectors and the trainer applies the head over the whole global batch (every view, every
    process), so a head that mixes rows (BatchNorm) sees the same batch however the step is split.
    """

    def __init__(self, pooler: str, hidden_size: int, mlp: str = "none"):
        super().__init__()
        check_choice("pooler", pooler, POOLERS)
        check_choice("mlp", mlp, MLP_MODES)
        if pooler == "cls_before_pooler" and mlp != "none":
            raise ValueError("pooler 'cls_before_pooler' never uses a head; use pooler 'cls' with an mlp mode")
        self.pooler, self.mlp = pooler, mlp
        if mlp == "none":
            self.head = None
        elif pooler == "bn_mlp":
            self.head = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.BatchNorm1d(hidden_size),
                                      nn.ReLU(), nn.Linear(hidden_size, hidden_size))
        else:
            self.head = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh())

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None,
                mask_token_id: int | None = None) -> torch.Tensor:
        return self.apply_head(self.pool(hidden, attention_mask, input_ids, mask_token_id))

    def apply_head(self, vec: torch.Tensor) -> torch.Tensor:
        """The trainable head over (rows, hidden) pooled vectors, when the mlp mode uses it in this mode."""
        if self.head is not None and (self.mlp == "always" or self.training):
            return self.head(vec)
        return vec

    def pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None,
             mask_token_id: int | None = None) -> torch.Tensor:
        """The sentence vector before the head: (B, S, hidden) -> (B, hidden)."""
        if self.pooler in ("cls", "cls_before_pooler", "bn_mlp"):
            vec = hidden[:, 0]
        elif self.pooler == "mean":
            m = attention_mask.to(hidden.dtype).unsqueeze(-1)
            vec = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        else:  # mask
            if input_ids is None or mask_token_id is None:
                raise ValueError("pooler 'mask' needs input_ids and a tokenizer with a mask token")
            is_mask = input_ids == mask_token_id
            missing = ~is_mask.any(1)
            if missing.any():
                raise ValueError(f"pooler 'mask': {int(missing.sum())} input(s) contain no mask token; "
                                 "encode with a template that contains [MASK]")
            first = is_mask.to(torch.int8).argmax(1)
            vec = hidden[torch.arange(hidden.shape[0], device=hidden.device), first]
        return vec

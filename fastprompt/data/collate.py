"""Tokenisation and collation: rows of sentences -> one padded tensor batch holding every view.

All views of a batch are encoded in one forward pass, laid out view-major: rows ``[v*B, (v+1)*B)`` are
view ``v`` of the ``B`` examples, so the encoder's ``(n_views*B, H)`` output reshapes to
``(n_views, B, H)``. Padding is dynamic: to the longest sequence of the batch, truncated at
``max_length`` tokens (32 by default, as in SimCSE/DCPCSE/PromCSE).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """Token ids of ``n_views`` views of ``batch_size`` examples, view-major."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None
    n_views: int
    batch_size: int

    def to(self, device: torch.device | str) -> "Batch":
        tt = self.token_type_ids.to(device) if self.token_type_ids is not None else None
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), tt, self.n_views, self.batch_size)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def hf_tokenize(tokenizer) -> Callable[[list[str], int], dict]:
    """A tokenize function over a Hugging Face tokenizer: dynamic padding, truncation at ``max_length``."""

    def tokenize(texts: list[str], max_length: int) -> dict:
        return dict(tokenizer(texts, padding="longest", truncation=True, max_length=max_length, return_tensors="pt"))

    return tokenize


class Collator:
    """Turns a list of rows (tuples of 1, 2 or 3 sentences) into a :class:`Batch`.

    ``tokenize(texts, max_length) -> {"input_ids", "attention_mask"[, "token_type_ids"]}`` pads to the longest
    text; pass ``PromptEncoder.tokenize`` (which also wraps sentences in a template when the encoder has one)
    or :func:`hf_tokenize` of a Hugging Face tokenizer. A one-sentence row is unsupervised SimCSE: the
    sentence is tokenised once and repeated as two views, which differ only by the encoder's dropout noise.
    """

    def __init__(self, tokenize: Callable[[list[str], int], dict], max_length: int = 32):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for the special tokens), got {max_length}")
        if not callable(tokenize):
            raise TypeError("tokenize must be a callable (texts, max_length) -> dict of tensors")
        self.tokenize = tokenize
        self.max_length = int(max_length)

    def __call__(self, rows: Sequence[tuple[str, ...]]) -> Batch:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        width = len(rows[0])
        if any(len(r) != width for r in rows):
            raise ValueError("all rows of a batch must have the same number of sentences")
        texts = [row[v] for v in range(width) for row in rows]
        enc = self.tokenize(texts, self.max_length)
        ids, mask = enc["input_ids"], enc["attention_mask"]
        tt = enc.get("token_type_ids")
        n_views = width
        if width == 1:  # two dropout views of the same tokens
            ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
            tt = tt.repeat(2, 1) if tt is not None else None
            n_views = 2
        return Batch(ids, mask, tt, n_views=n_views, batch_size=len(rows))

"""The matrix work of one prompted training step, counted exactly from the backbone's config shapes.

One count serves the training-step benchmark's FLOP floor (bench/bench_train_step.py) and the ``compile: null``
decision (:mod:`fastprompt.train.compile`). It counts floating-point operations (2 per multiply-add) of the
products a step cannot avoid; elementwise work (dropout, activations, LayerNorm, softmax) is not in it.

Per sequence of S tokens, per layer, with hidden size H, feed-forward size F, ``nh`` query heads and ``nkv``
key/value heads of width d (grouped-query attention: nkv < nh) and P prefix keys, the forward runs

- the projections: Q and the output (H x nh d each) and K, V (H x nkv d each): S H (2 nh d + 2 nkv d),
- the feed-forward: 2 S H F, or 3 S H F for a gated one (Llama-style gate/up/down, ModernBERT's GLU),
- attention: QK^T and PV over P + S keys for every query head: 2 S (P + S) nh d.

The backward with a frozen backbone needs the gradient of each product's input only: one product per projection
and feed-forward matrix, and four per attention (dP, dV, dQ, dK: twice the forward), since the prefix's gradient
flows back through every layer. Layer 0 needs less: its input comes from the frozen embeddings, so no gradient
into its Q/K/V projections' input, no dQ, and dK, dV of the P prefix keys only (not of the S token keys). With
``train_backbone`` every weight gets its gradient (one more product per projection and feed-forward matrix) and
the embeddings train, so layer 0 does its whole backward. The loss: a similarity matrix of the sentence
embeddings (H wide), forward and its two input gradients.

Padded or real tokens: ``tokens`` is one length for every row (the padded step) or each row's own length (the
real tokens: attention then costs S_i (P + S_i) per row, not S (P + S)).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepFlops:
    """Floating-point operations of one step's matrix products, by part. ``attention`` is the part of
    ``forward + backward`` in attention's batched products (QK^T, PV and their gradients); the rest are plain
    matmuls (projections, feed-forward, loss)."""

    forward: int
    backward: int
    loss: int
    attention: int

    @property
    def total(self) -> int:
        return self.forward + self.backward + self.loss


def _shapes(config) -> tuple[int, int, int, int, int, int, int]:
    """(layers, hidden, feed-forward width, query heads, key/value heads, head width, feed-forward matrices) of a
    Hugging Face config (DistilBERT's own names through its attribute map, ``hidden_dim`` for its FFN)."""
    H, L, nh = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    F = getattr(config, "intermediate_size", None) or getattr(config, "hidden_dim", None)
    if not F:
        raise ValueError(f"{type(config).__name__} names no feed-forward width (intermediate_size or hidden_dim)")
    nkv = getattr(config, "num_key_value_heads", None) or nh
    d = getattr(config, "head_dim", None) or H // nh
    from fastprompt.model.arch import family_of  # the family says whether its feed-forward is gated

    matrices = family_of(getattr(config, "model_type", None)).ffn_matrices
    return L, H, F, nh, nkv, d, matrices


def step_flops(config, tokens: int | Sequence[int], prompt_length: int = 0, *, rows: int | None = None,
               train_backbone: bool = False, similarity: tuple[int, int] | None = None) -> StepFlops:
    """The matrix work of one training step of a prompted encoder (see the module docstring for the count).

    ``tokens``: the tokens of every row (then ``rows`` says how many: the padded step), or a sequence of each row's
    length (the real tokens of a batch). ``similarity``: the loss's (queries, keys) similarity matrix; default
    ``(rows // 2, rows // 2)``, two views of ``rows / 2`` sentences (unsupervised SimCSE).
    """
    if isinstance(tokens, int):
        if rows is None:
            raise ValueError("a single token count needs rows= (how many sequences of that length)")
        lengths = [tokens] * rows
    else:
        lengths = [int(s) for s in tokens]
        if rows is not None and rows != len(lengths):
            raise ValueError(f"rows={rows} but {len(lengths)} lengths")
    if any(s < 0 for s in lengths) or prompt_length < 0:
        raise ValueError("token counts and prompt_length must be >= 0")
    L, H, F, nh, nkv, d, matrices = _shapes(config)
    P, n = prompt_length, len(lengths)
    S = sum(lengths)  # tokens of the whole batch
    SK = sum(s * (P + s) for s in lengths)  # query-key pairs of the whole batch
    SS = sum(s * s for s in lengths)  # query-token-key pairs
    qkv = S * H * (nh * d + 2 * nkv * d)
    proj = qkv + S * nh * d * H
    ffn = matrices * S * H * F
    attn = 2 * SK * nh * d  # QK^T and PV
    forward = L * (proj + ffn + attn)
    backward = L * (proj + ffn + 2 * attn)
    attention = L * 3 * attn
    if train_backbone:
        backward += L * (proj + ffn)  # the weight gradients
    else:
        # layer 0: no gradient into its input (Q/K/V projections), no dQ, no dK/dV of the token keys
        layer0 = SK * nh * d + 2 * SS * nh * d
        backward -= qkv + layer0
        attention -= layer0
    queries, keys = similarity if similarity is not None else (n // 2, n // 2)
    loss = 3 * queries * keys * H
    return StepFlops(forward=2 * forward, backward=2 * backward, loss=2 * loss, attention=2 * attention)

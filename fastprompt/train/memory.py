"""An up-front estimate of one training step's activation memory, checked against the free memory.

A batch far too large for the machine (``batch_size=1000000`` on a 16k-sentence corpus: one batch of every
sentence) is otherwise OOM-killed mid-step with no message. Before the first step the trainer estimates the
activations one step keeps alive for its backward pass and refuses to start when they exceed the memory
available, suggesting the gradient cache (``micro_batch_size``), which keeps one micro-batch's activations
alive at a time and gives the same gradients.

The estimate is per transformer layer and token, after Korthikanti et al. 2022 ("Reducing activation
recomputation in large transformer models", section 4.1): ``34 h`` bytes of 16-bit activations for the
attention and MLP blocks (LayerNorms, projections, GELU input, dropout masks) plus ``5 a k`` bytes of attention
scores (scores, softmax, dropout mask), with ``k`` keys (the sentence plus the prefix). In units of the
activation element size ``e`` (4 in fp32, 2 under autocast) that is ``17 e h + a k (2 e + 1)``. Gradient
checkpointing keeps each layer's input plus one layer's activations. On top come the trained parameters'
gradient and AdamW's two moments, each the parameter's size (12 bytes a float32 parameter): negligible for a
prompt, but ~1.2 GiB for a trained BERT-base backbone (110M parameters, ``train_backbone``). The weights
themselves are already loaded when the free memory is read, and a frozen backbone carries no gradient. It is
an estimate of the order of magnitude: the check refuses only runs that cannot fit, and ``check_memory=false``
turns it off.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from fastprompt.model.device import GiB, available_bytes
from fastprompt.model.device import size_text as _size

logger = logging.getLogger(__name__)

__all__ = ["GiB", "ModelShape", "activation_bytes", "available_bytes", "check_run_memory", "check_step_memory"]


@dataclass(frozen=True)
class ModelShape:
    """What a step's memory depends on: the backbone's layers, width and heads (keys include the prefix), and
    the bytes of the trained parameters (their gradient and AdamW moments are each that size again)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    prefix_length: int = 0
    trained_bytes: int = 0

    @classmethod
    def of(cls, encoder) -> "ModelShape":
        """The shape of ``encoder`` as it will train: call it after the trainable parameters are chosen
        (``train_backbone``)."""
        c = encoder.backbone.config
        prefix = int(getattr(encoder, "prompt_length", 0) or 0)
        trained = sum(p.numel() * p.element_size() for p in encoder.parameters() if p.requires_grad)
        return cls(int(c.num_hidden_layers), int(c.hidden_size), int(c.num_attention_heads), prefix, trained)

    @property
    def optimizer_bytes(self) -> int:
        """Gradient + AdamW's exp_avg and exp_avg_sq of the trained parameters (each the parameter's dtype)."""
        return 3 * self.trained_bytes


def activation_bytes(shape: ModelShape, sequences: int, seq_len: int, *, element_size: int = 4,
                     gradient_checkpointing: bool = False) -> int:
    """Activations kept for the backward pass of ``sequences`` sequences of ``seq_len`` tokens."""
    h, a, k = shape.hidden_size, shape.num_heads, seq_len + shape.prefix_length
    per_token_layer = 17 * element_size * h + a * k * (2 * element_size + 1)
    tokens = sequences * seq_len
    if gradient_checkpointing:  # each layer's input, plus one layer recomputed at a time
        return tokens * (shape.num_layers * element_size * h + per_token_layer)
    return tokens * shape.num_layers * per_token_layer


def check_step_memory(shape: ModelShape, *, rows: int, views: int, max_length: int, element_size: int,
                      micro_batch_rows: int | None, gradient_checkpointing: bool, available: int | None) -> int:
    """Raise a ValueError when one step's estimated activations exceed ``available`` bytes; returns the
    estimate. ``rows``: this process's rows per step; ``micro_batch_rows``: the gradient cache's rows per
    micro-batch (None: off)."""
    per_pass = min(rows, micro_batch_rows) if micro_batch_rows else rows
    need = activation_bytes(shape, per_pass * views, max_length, element_size=element_size,
                            gradient_checkpointing=gradient_checkpointing)
    if micro_batch_rows:  # the cached vectors and their gradients, for the whole batch
        need += 2 * rows * views * shape.hidden_size * 4
    state = shape.optimizer_bytes
    need += state
    logger.info("estimated memory of one step: %s%s (activations, and %s of gradients and AdamW moments)",
                _size(need), f" of {_size(available)} available" if available is not None else "", _size(state))
    if available is None or need <= available:
        return need
    if state >= available:
        raise ValueError(
            f"the trained parameters' gradients and AdamW moments alone need about {_size(state)} (3 x "
            f"{_size(shape.trained_bytes)} of trained weights), more than the {_size(available)} available; "
            "train fewer weights (train_backbone=false, a smaller model), or set check_memory=false to try anyway")
    per_row = activation_bytes(shape, views, max_length, element_size=element_size,
                               gradient_checkpointing=gradient_checkpointing)
    fit = max(1, int((available - state) // 2 // per_row))
    suggestion = 2 ** int(math.log2(fit)) if fit >= 2 else 1
    what = f"micro_batch_size={micro_batch_rows}" if micro_batch_rows else f"a batch of {rows} rows"
    raise ValueError(
        f"{what} x {views} views x {max_length} tokens needs about {_size(need)} of memory per step "
        f"(estimate{f', {_size(state)} of it gradients and AdamW moments' if state >= available // 100 else ''}), "
        f"more than the {_size(available)} available; set micro_batch_size={suggestion} "
        "(the gradient cache: same gradients, one micro-batch in memory at a time), lower batch_size or "
        "max_length, or set check_memory=false to try anyway")


def check_run_memory(cfg, encoder, views: int, *, rows_available: int, world_size: int, device) -> int:
    """:func:`check_step_memory` for a training run: this process's share of a batch of the config's
    ``batch_size`` (at most ``rows_available`` training rows) with ``views`` views a row, the config's precision,
    gradient cache and checkpointing, against the memory free on ``device``."""
    lb = cfg.large_batch
    rows = min(cfg.optim.batch_size, rows_available) // world_size
    micro = lb.micro_batch_size or (lb.max_tokens_per_micro_batch // cfg.data.max_length) or None
    return check_step_memory(ModelShape.of(encoder), rows=rows, views=views, max_length=cfg.data.max_length,
                             element_size=4 if cfg.run.precision == "fp32" else 2, micro_batch_rows=micro,
                             gradient_checkpointing=lb.gradient_checkpointing, available=available_bytes(device))

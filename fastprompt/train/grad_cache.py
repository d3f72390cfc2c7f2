"""Gradient cache (GradCache, Gao et al. 2021) for contrastive batches larger than activation memory.

One step over a global batch of ``rows = n_views * batch_size`` sequences:

1. embed the rows micro-batch by micro-batch without a graph, remembering each micro-batch's RNG state;
2. compute the loss over all embeddings, with gradients taken only w.r.t. the embeddings (a leaf tensor);
3. re-embed each micro-batch with a graph, replaying its RNG state so every dropout mask (backbone attention
   and hidden dropout, prompt dropout, in-kernel attention dropout seeded from torch's generator) is the same
   as in step 1, and backpropagate ``dot(embedding, cached_gradient)``.

The prompt gradients are then exactly those of the full-batch loss for the dropout masks drawn, while at most
one micro-batch's activations are alive at a time. Micro-batches are formed over rows sorted by length and
trim their own padding, so short sentences do not pay for long ones.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    rows: torch.Tensor  # indices into the global batch's rows
    inputs: dict[str, torch.Tensor]  # padding trimmed to the longest row of this micro-batch


def plan_micro_batches(attention_mask: torch.Tensor, micro_batch_size: int | None = None,
                       max_tokens: int | None = None) -> list[torch.Tensor]:
    """Split rows into micro-batches: at most ``micro_batch_size`` rows and at most ``max_tokens`` padded
    tokens (rows x longest row) each. Rows are grouped by length so padding is small."""
    if micro_batch_size is None and max_tokens is None:
        raise ValueError("set micro_batch_size or max_tokens_per_micro_batch")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    lengths = attention_mask.sum(1).cpu()
    if max_tokens is not None and max_tokens < int(lengths.max()):
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} is smaller than one sequence "
                         f"({int(lengths.max())} tokens)")
    order = torch.argsort(lengths, descending=True, stable=True)
    groups, start, n = [], 0, len(order)
    while start < n:
        longest = int(lengths[order[start]])  # sorted: the first row of a group is its longest
        size = n - start
        if micro_batch_size is not None:
            size = min(size, micro_batch_size)
        if max_tokens is not None:
            size = min(size, max(1, max_tokens // max(longest, 1)))
        groups.append(order[start:start + size])
        start += size
    return groups


def make_micro_batches(inputs: dict[str, torch.Tensor], groups: list[torch.Tensor]) -> list[MicroBatch]:
    mask = inputs["attention_mask"]
    out = []
    for rows in groups:
        rows_dev = rows.to(mask.device)
        width = max(int(mask[rows_dev].sum(1).max()), 1)
        # Padding sits on the right (dynamic right-padding), so the first `width` columns hold every real token.
        out.append(MicroBatch(rows, {k: v[rows_dev, :width] for k, v in inputs.items() if v is not None}))
    return out


class RandState:
    """Torch's CPU and CUDA generator states at one instant, to replay dropout exactly."""

    def __init__(self, device: torch.device):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.device = device

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


@dataclass
class CachedStepResult:
    loss: torch.Tensor  # detached scalar
    output: object  # whatever the loss function returned (e.g. an ObjectiveOutput)
    backpropagated: bool  # False when the loss was not finite: no gradient was written


def grad_cache_step(encode: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
                    loss_fn: Callable[[torch.Tensor], object], *, micro_batch_size: int | None = None,
                    max_tokens: int | None = None, loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None) -> CachedStepResult:
    """One gradient-cached forward/backward over all rows of ``inputs``; gradients accumulate into ``.grad``.

    encode: ``encode(input_ids=..., attention_mask=...[, token_type_ids=...]) -> (rows, dim)`` (the encoder,
        or its DDP wrapper).
    loss_fn: maps the (rows, dim) fp32 embeddings, in the original row order, to a scalar loss tensor or to an
        object with a ``.loss`` attribute (e.g. :class:`fastprompt.objectives.ObjectiveOutput`).
    loss_scale: applied to the loss before its backward (a GradScaler's ``scale``).
    no_sync: context manager that suspends DDP's gradient all-reduce; used for every micro-batch backward but
        the last, so gradients are synchronised once per step.
    """
    device = inputs["input_ids"].device
    groups = plan_micro_batches(inputs["attention_mask"], micro_batch_size, max_tokens)
    micro = make_micro_batches(inputs, groups)
    rows = inputs["input_ids"].shape[0]

    # 1) embeddings without a graph
    states, chunks = [], []
    with torch.no_grad():
        for mb in micro:
            states.append(RandState(device))
            with autocast():
                chunks.append(encode(**mb.inputs).float())
    after_first_pass = RandState(device)
    reps = torch.empty(rows, chunks[0].shape[1], dtype=torch.float32, device=chunks[0].device)
    for mb, emb in zip(micro, chunks):
        reps[mb.rows.to(reps.device)] = emb
    del chunks
    reps.requires_grad_(True)

    # 2) loss and its gradient w.r.t. the embeddings only
    output = loss_fn(reps)
    loss = output if torch.is_tensor(output) else output.loss
    if not torch.isfinite(loss):
        return CachedStepResult(loss.detach(), output, backpropagated=False)
    (loss_scale(loss) if loss_scale is not None else loss).backward()
    grads = reps.grad

    # 3) re-embed with a graph, replaying each micro-batch's RNG state, and backpropagate dot(emb, grad)
    for i, (mb, state) in enumerate(zip(micro, states)):
        state.restore()
        last = i == len(micro) - 1
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx:
            with autocast():
                emb = encode(**mb.inputs).float()
            emb.backward(grads[mb.rows.to(grads.device)])
    after_first_pass.restore()  # the RNG continues as if the step had run once
    return CachedStepResult(loss.detach(), output, backpropagated=True)


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

:func:`grad_cache_step` is the whole recipe for a loss of embeddings only; the trainer's
:class:`~fastprompt.train.steps.CachedStep` reuses passes 1 and 3 (:func:`embed_without_graph`,
:func:`backprop_cached`) around a second pass that also runs the pooler head and token-level terms.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fastprompt.host_sync import host_side


@dataclass
class MicroBatch:
    rows: torch.Tensor  # indices into the global batch's rows
    inputs: dict[str, torch.Tensor]  # padding trimmed to the longest row of this micro-batch
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # the rows' token-aligned extras, trimmed alike
    lengths: tuple[int, ...] | None = None  # the rows' real-token counts on the host (Batch.lengths), if known

    def encode(self, encode: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``encode(**inputs)``, with ``lengths=`` too when the host lengths are known."""
        return encode(**self.inputs) if self.lengths is None else encode(**self.inputs, lengths=self.lengths)


def plan_micro_batches(lengths: torch.Tensor | Sequence[int], micro_batch_size: int | None = None,
                       max_tokens: int | None = None) -> list[torch.Tensor]:
    """Split rows into micro-batches: at most ``micro_batch_size`` rows and at most ``max_tokens`` padded
    tokens (rows x longest row) each. Rows are grouped by length so padding is small. ``lengths``: the rows'
    real-token counts on the host (``Batch.lengths``), or their (rows, S) attention mask (read on the host: a
    device sync on a GPU). Returns CPU index tensors."""
    if micro_batch_size is None and max_tokens is None:
        raise ValueError("set micro_batch_size or max_tokens_per_micro_batch")
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if isinstance(lengths, torch.Tensor) and lengths.dim() == 2:
        lengths = lengths.sum(1).cpu()  # host read: a caller without host lengths (Batch.lengths has them)
    else:
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
    with host_side():
        lengths = lengths.tolist()  # host read: a CPU tensor
    if max_tokens is not None and max_tokens < max(lengths):
        raise ValueError(f"max_tokens_per_micro_batch={max_tokens} is smaller than one sequence "
                         f"({max(lengths)} tokens)")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # longest first; stable: ties keep their order
    groups, start, n = [], 0, len(order)
    while start < n:
        longest = lengths[order[start]]  # sorted: the first row of a group is its longest
        size = n - start
        if micro_batch_size is not None:
            size = min(size, micro_batch_size)
        if max_tokens is not None:
            size = min(size, max(1, max_tokens // max(longest, 1)))
        groups.append(torch.tensor(order[start:start + size], dtype=torch.int64))
        start += size
    return groups


def make_micro_batches(inputs: dict[str, torch.Tensor], groups: list[torch.Tensor],
                       extras: dict[str, torch.Tensor] | None = None,
                       lengths: Sequence[int] | None = None) -> list[MicroBatch]:
    """The rows of each group, with the padding columns no row of the group uses trimmed away. ``lengths``: the
    rows' real-token counts on the host (``Batch.lengths``): the widths come from them, not from the mask (read on
    the host otherwise: a device sync on a GPU), and each micro-batch carries its own."""
    mask = inputs["attention_mask"]
    out = []
    for rows in groups:
        rows_dev = rows.to(mask.device, non_blocking=True)
        if lengths is None:
            # host read: a caller without host lengths (Batch.lengths has them)
            mb_lengths, width = None, max(int(mask[rows_dev].sum(1).max()), 1)
        else:
            with host_side():
                mb_lengths = tuple(lengths[i] for i in rows.tolist())  # host read: the plan's CPU indices
            width = max(max(mb_lengths), 1)
        # Padding sits on the right (dynamic right-padding), so the first `width` columns hold every real token.
        # 1-D inputs are per-row values (a row's template index): sliced by row only.
        out.append(MicroBatch(rows, {k: v[rows_dev, :width] if v.dim() > 1 else v[rows_dev]
                                     for k, v in inputs.items() if v is not None},
                              {k: v[rows_dev, :width] for k, v in (extras or {}).items()}, mb_lengths))
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


class Replay:
    """The RNG states of a gradient cache's first pass: one per micro-batch, and the state after the pass."""

    def __init__(self, states: list[RandState], after: RandState):
        self.states, self.after = states, after

    def finish(self) -> None:
        """Continue the RNG as if the step had run once (call after the last replayed forward)."""
        self.after.restore()


def embed_without_graph(encode: Callable[..., torch.Tensor], micro: list[MicroBatch], rows: int,
                        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                        ) -> tuple[torch.Tensor, Replay]:
    """Pass 1: (rows, dim) fp32 embeddings in the original row order, and the RNG states to replay."""
    device = micro[0].inputs["input_ids"].device
    states, chunks = [], []
    with torch.no_grad():
        for mb in micro:
            states.append(RandState(device))
            with autocast():
                chunks.append(mb.encode(encode).float())
    replay = Replay(states, RandState(device))
    reps = torch.empty(rows, chunks[0].shape[1], dtype=torch.float32, device=chunks[0].device)
    for mb, emb in zip(micro, chunks):
        reps[mb.rows.to(reps.device, non_blocking=True)] = emb
    return reps, replay


def backprop_cached(encode: Callable[..., torch.Tensor], micro: list[MicroBatch], replay: Replay,
                    grads: torch.Tensor,
                    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None) -> None:
    """Pass 3: re-embed each micro-batch with a graph, replaying its RNG state, and backpropagate
    ``dot(embedding, cached gradient)``; then continue the RNG as after pass 1."""
    for i, (mb, state) in enumerate(zip(micro, replay.states)):
        state.restore()
        last = i == len(micro) - 1
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx:
            with autocast():
                emb = mb.encode(encode).float()
            emb.backward(grads[mb.rows.to(grads.device, non_blocking=True)])
    replay.finish()


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

    The classic GradCache for a loss of embeddings only (the trainer's :class:`~fastprompt.train.steps.CachedStep`
    adds the pooler head and token-level terms on top of the same two passes).

    encode: ``encode(input_ids=..., attention_mask=...[, token_type_ids=...]) -> (rows, dim)`` (an encoder,
        or a DistributedDataParallel wrapper of one).
    loss_fn: maps the (rows, dim) fp32 embeddings, in the original row order, to a scalar loss tensor or to an
        object with a ``.loss`` attribute (e.g. :class:`fastprompt.objectives.ObjectiveOutput`).
    loss_scale: applied to the loss before its backward (a GradScaler's ``scale``).
    no_sync: context manager that suspends a DDP wrapper's gradient all-reduce; used for every micro-batch
        backward but the last, so gradients are synchronised once per step.
    """
    groups = plan_micro_batches(inputs["attention_mask"], micro_batch_size, max_tokens)
    micro = make_micro_batches(inputs, groups)
    reps, replay = embed_without_graph(encode, micro, inputs["input_ids"].shape[0], autocast)
    reps.requires_grad_(True)

    output = loss_fn(reps)  # 2) the loss and its gradient w.r.t. the embeddings only
    loss = output if torch.is_tensor(output) else output.loss
    if not torch.isfinite(loss):
        return CachedStepResult(loss.detach(), output, backpropagated=False)
    (loss_scale(loss) if loss_scale is not None else loss).backward()
    backprop_cached(encode, micro, replay, reps.grad, autocast, no_sync)
    return CachedStepResult(loss.detach(), output, backpropagated=True)

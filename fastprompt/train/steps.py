"""One optimisation step's forward and backward: :class:`PlainStep` or :class:`CachedStep`, chosen at setup.

Both leave in ``.grad`` this process's share of the gradients of the method's loss on the global batch
(the contract: :mod:`fastprompt.objectives.base`)::

    L = sentence(head(pre-head vectors of every view of every process's rows))
        + sum_t weight_t(step) * (sum of term t's per-target losses over the global batch) / N_t

where ``N_t`` is term t's number of target tokens in the global batch. Each process backpropagates its
additive share of ``L``: its sentence loss (a mean over its anchors) times ``B_local / B_global``, and its
rows' token-term sums divided by the global ``N_t``; the trainer then sums the gradients over processes
(:meth:`~fastprompt.train.distributed.DistributedContext.all_reduce_gradients`).

The **loss side** (:class:`LossSide`) is shared: the pooler head runs there, over the all-gathered pre-head
vectors of the whole global batch, so a head that mixes rows (BatchNorm) sees the same rows with or without
the gradient cache and with any number of processes.

:class:`PlainStep` computes the whole local batch in one graph. :class:`CachedStep` is the gradient cache:

1. embed micro-batches without a graph (recording each one's RNG state): pre-head vectors R;
2. loss side with R as a leaf: head, sentence loss. For each micro-batch, each token term runs its own
   forwards with a graph (on the micro-batch's extras; a term that reads the post-head sentence embeddings
   gets them as a detached leaf ``h``, the pre-head ones as R's rows) and is backpropagated at once (prompt
   and term gradients, and ``h.grad``). Then ``sentence_share + sum(emb * h.grad)`` is backpropagated to R,
   giving R's cached gradient;
3. re-embed each micro-batch with a graph, replaying its RNG state, and backpropagate ``dot(R, grad)``.

Token-term forwards run under :func:`torch.random.fork_rng` seeded by :func:`term_seed` (step seed, term name,
micro-batch index): they neither shift the sentence forwards' dropout stream nor depend on when they run.
"""
from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fastprompt.data import Batch
from fastprompt.objectives.base import AFTER_HEAD, BEFORE_HEAD, Method, ObjectiveOutput, TokenTerm, Views
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import backprop_cached, embed_without_graph, make_micro_batches, plan_micro_batches

AutocastFactory = Callable[[], contextlib.AbstractContextManager]


def step_seed(seed: int, step: int) -> int:
    """The torch seed of one optimisation step (a pure function, so any step's dropout can be replayed)."""
    return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1, dtype=np.uint64)[0] >> 1)


def term_seed(seed: int, name: str, index: int) -> int:
    """The seed of token term ``name``'s forward on micro-batch ``index`` of the step seeded ``seed``; index -1
    is the term's extras (see :func:`extras_generators`)."""
    words = [int(seed), zlib.crc32(name.encode()), index + 1]
    return int(np.random.SeedSequence(words).generate_state(1, dtype=np.uint64)[0] >> 1)


def extras_generators(method: Method, seed: int) -> dict[str, torch.Generator]:
    """One CPU generator per token term, for its ``make_extras`` in the step seeded ``seed``."""
    return {t.name: torch.Generator().manual_seed(term_seed(seed, t.name, -1)) for t in method.terms}


@contextlib.contextmanager
def forked_rng(seed: int, device: torch.device):
    """Run a block on torch's generators (CPU, and ``device`` if CUDA) seeded ``seed``, then restore them."""
    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        yield


@dataclass
class StepLosses:
    """What a step reports, left on the device (a step never reads a device tensor on the host: the trainer reads
    them at its log rows). loss: the global-batch loss, a detached 0-d tensor, the same on every process (non-finite:
    the gradients it left are not usable, and the trainer skips the update). stats: the sentence objective's
    statistics (this process's rows), and with token terms ``loss_sentence``, ``loss_<name>`` (unweighted mean over
    the global batch's targets) and ``w_<name>``: 0-d tensors or floats."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor | float]


class LossSide:
    """The part of a step that sees embeddings: pooler head, sentence objective, token-term bookkeeping."""

    def __init__(self, method: Method, encoder, dist: DistributedContext, *,
                 autocast: AutocastFactory = contextlib.nullcontext,
                 loss_scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 embed: Callable[..., torch.Tensor] | None = None):
        self.method, self.encoder, self.dist = method, encoder, dist
        # model inputs -> pre-head vectors (rows, H); PromptBERT's views pool each row at its own template
        self.embed = embed or functools.partial(encoder, head=False)
        # the encoder's own forward takes the rows' host-side lengths (a packed forward's, so that it never reads the
        # mask on the GPU; an unpacked forward does not need them, and a compiled one would guard on their count)
        self._embed_takes_lengths = embed is None
        self.autocast = autocast
        self.loss_scale = loss_scale or (lambda loss: loss)

    def embed_rows(self, *, lengths: tuple[int, ...] | None = None, **inputs: torch.Tensor) -> torch.Tensor:
        """Pre-head vectors of some rows; ``lengths``: their real-token counts on the host (``Batch.lengths``)."""
        if self._embed_takes_lengths and lengths is not None and getattr(self.encoder, "packed", False):
            return self.embed(**inputs, lengths=lengths)
        return self.embed(**inputs)

    def sentence(self, reps: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, ObjectiveOutput, torch.Tensor]:
        """``reps``: (rows, H) pre-head vectors of this process's rows. Returns this process's share of the
        sentence loss, the objective's output, and the post-head embeddings of this process's rows (rows, H)."""
        n, b = batch.n_views, batch.batch_size
        gathered = self.dist.gather_batch(reps.view(n, b, -1))
        total = gathered.shape[1]
        emb = self.encoder.pooler.apply_head(gathered.reshape(n * total, -1)).view(n, total, -1)
        offset = self.dist.rank * b
        ids = self.dist.gather_ids(batch.text_ids.view(n, b)) if batch.text_ids is not None else None
        views = Views(batch.view_names, emb[:, offset:offset + b], emb, offset, ids)
        out = self.method.sentence(views)
        return out.loss * (b / total), out, views.local.reshape(n * b, -1)

    def target_counts(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Each term's number of target tokens in the global batch (at least 1, so an empty term is 0)."""
        return {t.name: self.dist.sum(t.num_targets(batch.extras).float()).clamp_min(1.0) for t in self.method.terms}

    def term_sum(self, term: TokenTerm, inputs: dict, extras: dict, h: dict[str, torch.Tensor], seed: int,
                 index: int) -> torch.Tensor:
        """Term's per-target loss sum over some rows (micro-batch ``index``), on its own RNG stream.

        ``h``: these rows' sentence embeddings, ``{AFTER_HEAD: ..., BEFORE_HEAD: ...}``."""
        with forked_rng(term_seed(seed, term.name, index), inputs["input_ids"].device), self.autocast():
            return term(self.encoder, inputs, extras, h.get(term.sentence_embedding)).float()

    def backward(self, loss: torch.Tensor) -> None:
        self.loss_scale(loss).backward()

    def report(self, sentence_total: torch.Tensor, out: ObjectiveOutput, term_sums: dict[str, torch.Tensor],
               counts: dict[str, torch.Tensor], step: int) -> StepLosses:
        """The global losses, on the device: ``sentence_total`` is the sum of every process's sentence share."""
        sentence = sentence_total.detach().float()
        stats, loss = dict(out.stats), sentence
        if term_sums:
            stats["loss_sentence"] = sentence
        for t in self.method.terms:
            mean, w = self.dist.sum(term_sums[t.name]) / counts[t.name], t.weight(step)
            stats[f"loss_{t.name}"], stats[f"w_{t.name}"] = mean, w
            loss = loss + w * mean
        return StepLosses(loss, stats)


class PlainStep:
    """The whole local batch in one graph: embed, loss side, token terms (micro-batch index 0), one backward."""

    def __init__(self, loss_side: LossSide):
        self.loss_side = loss_side

    def __call__(self, batch: Batch, step: int, seed: int) -> StepLosses:
        side = self.loss_side
        inputs = batch.model_inputs()
        with side.autocast():
            reps = side.embed_rows(**inputs, lengths=batch.lengths)
        share, out, emb = side.sentence(reps.float(), batch)
        # A non-finite loss is backpropagated too (deciding otherwise would read it on the host, waiting for the
        # GPU): its gradients are not finite either, and the trainer skips the update on the device.
        sentence_total = side.dist.sum(share)
        counts = side.target_counts(batch)
        total, sums = share, {}
        h = {AFTER_HEAD: emb, BEFORE_HEAD: reps.float()}
        for t in side.method.terms:
            s = side.term_sum(t, inputs, batch.extras, h, seed, 0)
            total = total + t.weight(step) * s / counts[t.name]
            sums[t.name] = s.detach()
        side.backward(total)
        return side.report(sentence_total, out, sums, counts, step)


class CachedStep:
    """The gradient cache (module docstring): at most one micro-batch's activations alive at a time."""

    def __init__(self, loss_side: LossSide, *, micro_batch_size: int | None, max_tokens: int | None):
        self.loss_side = loss_side
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens

    def __call__(self, batch: Batch, step: int, seed: int) -> StepLosses:
        side = self.loss_side
        inputs = batch.model_inputs()
        lengths = batch.lengths if batch.lengths is not None else inputs["attention_mask"]
        groups = plan_micro_batches(lengths, self.micro_batch_size, self.max_tokens)
        micro = make_micro_batches(inputs, groups, batch.extras, lengths=batch.lengths)
        encode = side.embed_rows
        reps, replay = embed_without_graph(encode, micro, batch.rows, side.autocast)  # 1)
        reps.requires_grad_(True)

        share, out, emb = side.sentence(reps, batch)  # 2)
        sentence_total = side.dist.sum(share)  # a non-finite loss is backpropagated too (PlainStep says why)
        counts = side.target_counts(batch)
        # Terms read h as leaves: the post-head embeddings detached (their gradient is carried back through
        # the head below), the pre-head vectors as R itself (their gradient lands in R.grad directly).
        h_after = emb.detach().requires_grad_(True)
        sums = {t.name: torch.zeros((), device=reps.device) for t in side.method.terms}
        for i, mb in enumerate(micro):
            rows = mb.rows.to(reps.device)
            h = {AFTER_HEAD: h_after[rows], BEFORE_HEAD: reps[rows]}
            for t in side.method.terms:
                s = side.term_sum(t, mb.inputs, mb.extras, h, seed, i)
                side.backward(t.weight(step) * s / counts[t.name])
                sums[t.name] += s.detach()
        surrogate = side.loss_scale(share)
        if h_after.grad is not None:  # already scaled: it came from scaled backwards
            surrogate = surrogate + (emb * h_after.grad).sum()
        surrogate.backward()  # accumulates into R.grad, after any pre-head term gradients

        backprop_cached(encode, micro, replay, reps.grad, side.autocast)  # 3)
        return side.report(sentence_total, out, sums, counts, step)

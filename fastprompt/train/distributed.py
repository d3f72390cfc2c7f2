"""More than one process (``torchrun``): the global batch's loss side on every process, one gradient sum per step.

Every process embeds its own shard of the global batch. The loss side all-gathers the pre-head vectors of all
views *with gradient* (:meth:`DistributedContext.gather_batch`), so every process applies the pooler head to
the whole global batch (a BatchNorm head sees exactly the rows of a one-process run and keeps identical
running statistics everywhere) and contrasts its own anchors against every process's columns. Each process
backpropagates its additive share of the global loss (see :mod:`fastprompt.train.steps`); the all-gather's
backward sums the gradients of the gathered vectors back to their owners, and
:meth:`DistributedContext.all_reduce_gradients` sums the parameter gradients once per step. Together they give
exactly the gradients of the one-process loss on the global batch.

No ``DistributedDataParallel``: its reducer expects every parameter's gradient from the wrapped forward, while
here the head gets its gradient on the loss side, token terms run their own forwards through the encoder, and
the gradient cache backpropagates through many forwards per step. One explicit all-reduce of the flattened
gradients per optimisation step is what DDP would do at the end, without those constraints.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # init_distributed created the process group, so shutdown() destroys it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather_batch(self, x: torch.Tensor) -> torch.Tensor:
        """(n_views, B_local, ...) of every process -> (n_views, B_global, ...), process-major within each view,
        with gradient (the backward sums every process's gradient into the owner's rows)."""
        if not self.enabled:
            return x
        from torch.distributed.nn.functional import all_gather

        sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([x.shape[1]], device=x.device))
        if len({int(s) for s in sizes}) != 1:
            raise ValueError(f"every process needs the same local batch size to gather the batch, got "
                             f"{[int(s) for s in sizes]}")
        return torch.cat(all_gather(x.contiguous()), dim=1)

    def gather_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """(n_views, B_local) integer ids of every process -> (n_views, B_global), laid out as :meth:`gather_batch`
        lays out the embeddings (no gradient: ids are labels)."""
        if not self.enabled:
            return ids
        parts = [torch.empty_like(ids) for _ in range(self.world_size)]
        dist.all_gather(parts, ids.contiguous())
        return torch.cat(parts, dim=1)

    def local_rows(self, rows: list[int]) -> list[int]:
        """This process's equal shard of a global batch's rows (all of them in a single process)."""
        if not self.enabled:
            return rows
        n = len(rows) // self.world_size
        return rows[self.rank * n:(self.rank + 1) * n]

    def agree(self, flag: bool) -> bool:
        """A decision every process takes together: true if any process's ``flag`` is."""
        if not self.enabled:
            return flag
        return bool(self.sum(torch.tensor(float(flag), device=self.device)) > 0)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a (detached) tensor over processes."""
        value = value.detach().clone()
        if self.enabled:
            dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def all_reduce_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum the parameters' gradients over processes: one flattened all-reduce per dtype (a parameter
        without a gradient contributes zeros, and gets the sum). Frozen parameters (``requires_grad=False``,
        such as word embeddings an MLM head's decoder is tied to) are skipped, and each parameter counts once."""
        if not self.enabled:
            return
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        seen: set[int] = set()
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                by_dtype.setdefault(p.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for p, chunk in zip(group, flat.split([p.numel() for p in group])):
                p.grad = chunk.view_as(p).clone()

    def broadcast_from_main(self, tensors: Iterable[torch.Tensor]) -> None:
        """Copy the main process's values of these tensors (parameters, buffers) to every process."""
        if self.enabled:
            for t in tensors:
                dist.broadcast(t.data, src=0)

    def barrier(self):
        if self.enabled:
            dist.barrier()

    def shutdown(self) -> None:
        """Destroy the process group this context created (a no-op otherwise)."""
        if self.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False


def init_distributed(device: str | None = None) -> DistributedContext:
    """Set up ``torch.distributed`` from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).

    gloo on CPU, NCCL on CUDA. Without those variables (a plain ``python`` run) nothing is initialised.
    ``device``: as :func:`fastprompt.model.device.resolve_device` takes it (None or "auto": CUDA when available).
    """
    from fastprompt.model.device import resolve_device

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device)  # a device this machine lacks fails here, before any model loads
    if dev.type == "cuda":
        if world > 1 or dev.index is None:  # under torchrun every process takes the GPU of its local rank
            dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    owns = world > 1 and not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        logger.info("torch.distributed: rank %d of %d on %s", rank, world, dev)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistributedContext(rank=rank, world_size=world, local_rank=local, device=dev, owns_group=owns)

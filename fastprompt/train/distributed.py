"""More than one process (``torchrun``): negatives across processes and one gradient sync per step.

Every process embeds its own shard of the global batch; the positives and hard negatives of all processes
are all-gathered *with gradient* (``torch.distributed.nn.functional.all_gather``), so each process contrasts
its anchors against the whole global batch. Each process's loss is the mean over its own anchors; the
all-gather's backward sums the column gradients back to their owners and DDP averages the parameter
gradients over processes, which together give exactly the gradient of the global-batch mean loss.
"""
from __future__ import annotations

import contextlib
import logging
import os
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

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """DDP over the trainable parameters (the frozen backbone is not synchronised: it has no gradients)."""
        if not self.enabled:
            return module
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(module, device_ids=ids)

    def no_sync(self, wrapped: torch.nn.Module):
        """Context factory that defers DDP's all-reduce (used for all micro-batches but the last)."""
        if self.enabled and hasattr(wrapped, "no_sync"):
            return wrapped.no_sync
        return contextlib.nullcontext

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a (detached) scalar over processes, for logging."""
        if not self.enabled:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def barrier(self):
        if self.enabled:
            dist.barrier()

    def shutdown(self) -> None:
        """Destroy the process group this context created (a no-op otherwise).

        Drop every DDP wrapper first: a DDP reducer that outlives the group frees it from Python with the
        GIL held, while a gloo worker thread may need the GIL to release its last work's tensors: a
        deadlock at exit (pytorch/pytorch#56297). Destroyed here, the group is freed with the GIL released.
        """
        if self.owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            self.owns_group = False


def init_distributed(device: str | None = None) -> DistributedContext:
    """Set up ``torch.distributed`` from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK).

    gloo on CPU, NCCL on CUDA. Without those variables (a plain ``python`` run) nothing is initialised.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    owns = world > 1 and not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        logger.info("torch.distributed: rank %d of %d on %s", rank, world, dev)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistributedContext(rank=rank, world_size=world, local_rank=local, device=dev, owns_group=owns)


def gather_views(z1: torch.Tensor, z2: torch.Tensor, z3: torch.Tensor | None, ctx: DistributedContext):
    """(local anchors, all-gathered positives, all-gathered hard negatives, positive_offset)."""
    if not ctx.enabled:
        return z1, z2, z3, 0
    from torch.distributed.nn.functional import all_gather

    sizes = [torch.zeros(1, dtype=torch.long, device=z1.device) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, torch.tensor([z1.shape[0]], device=z1.device))
    if len({int(s) for s in sizes}) != 1:
        raise ValueError(f"every process needs the same local batch size to gather negatives, got "
                         f"{[int(s) for s in sizes]}")
    g2 = torch.cat(all_gather(z2.contiguous()))
    g3 = torch.cat(all_gather(z3.contiguous())) if z3 is not None else None
    return z1, g2, g3, ctx.rank * z1.shape[0]


class GlobalBatchObjective:
    """Wraps an objective so the columns span every process's embeddings."""

    def __init__(self, objective, ctx: DistributedContext):
        self.objective, self.ctx = objective, ctx

    def __call__(self, embeddings: torch.Tensor):
        """``embeddings``: (n_views, local_batch, dim)."""
        if not self.ctx.enabled:
            return self.objective(embeddings)
        from fastprompt.objectives import split_views

        z1, z2, z3 = split_views(embeddings)
        z1, g2, g3, offset = gather_views(z1, z2, z3, self.ctx)
        return self.objective.from_views(z1, g2, g3, positive_offset=offset)

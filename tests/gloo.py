"""Tests over two processes and gloo: the spawn that fails instead of hanging, a free port, and the prologue every
worker shares (the process group on localhost, one thread per process, the DistributedContext) as one context
manager. Imported by the workers too (spawned processes import their test module, and with it this one)."""
from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp


def spawn(fn, args, nprocs=2, timeout=300):
    """mp.spawn that fails instead of hanging the suite when a process never finishes."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{fn.__name__}: processes still running after {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """A worker's gloo process group on localhost, with one torch thread (two processes share the cores); yields
    its :class:`~fastprompt.train.distributed.DistributedContext` and destroys the group on the way out."""
    from fastprompt.train.distributed import DistributedContext

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        yield DistributedContext(rank=rank, world_size=world)
    finally:
        torch.distributed.destroy_process_group()

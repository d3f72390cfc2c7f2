"""Two gloo processes on CPU give the same loss and prompt gradients as one process on the global batch."""
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import SimCSE
from fastprompt.train.distributed import DistributedContext, GlobalBatchObjective
from fastprompt.train.grad_cache import grad_cache_step

PAIRS = [("a man plays the guitar .", "a man plays music"), ("the dog runs", "a dog is running"),
         ("two people sit at a table", "people sit"), ("it is red", "the car is red"),
         ("a woman eats food", "someone is eating"), ("the cat sits", "a cat"),
         ("one big ball", "a small ball"), ("water in the park", "the park has water")]
NEGS = ["the cat runs", "nobody plays", "a table", "blue", "a man sits", "the dog eats", "two cars", "food"]


def _encoder(model_dir):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3))
    return enc.eval()  # dropout off: processes draw from different RNG streams


def _views(enc, rows):
    """Tokenise (anchor, positive, hard negative) rows view-major, padded together."""
    texts = [r[v] for v in range(3) for r in rows]
    return enc.tokenize(texts)


def _objective():
    return SimCSE(temperature=0.05, hard_negative_weight=0.5, hinge_weight=1.0, backend="reference")


def _train_step(rank, world, model_dir, out_dir, cached):
    ctx = DistributedContext(rank=rank, world_size=world)
    enc = _encoder(model_dir)
    ddp = ctx.wrap(enc)
    n = len(PAIRS) // world
    rows = [(a, p, h) for (a, p), h in zip(PAIRS, NEGS)][rank * n:(rank + 1) * n]
    tok = _views(enc, rows)
    objective = GlobalBatchObjective(_objective(), ctx)
    loss_fn = lambda reps: objective(reps.view(3, n, -1))  # noqa: E731
    if cached:
        res = grad_cache_step(ddp, tok, loss_fn, micro_batch_size=2, no_sync=ctx.no_sync(ddp))
        loss = res.loss
    else:
        loss = loss_fn(ddp(**tok)).loss
        loss.backward()
    save_file({"loss": ctx.mean(loss).reshape(1), "grad": enc.prompt.prefix.grad.contiguous()},
              os.path.join(out_dir, f"rank{rank}.safetensors"))


def _worker(rank, world, model_dir, port, out_dir, cached):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # the DDP wrapper dies with _train_step's frame, before the group: a reducer that outlives the
        # group can deadlock the process at exit (see DistributedContext.shutdown)
        _train_step(rank, world, model_dir, out_dir, cached)
    finally:
        torch.distributed.destroy_process_group()


def _spawn(fn, args, nprocs=2, timeout=300):
    """mp.spawn that fails instead of hanging the suite when a process never finishes."""
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"{fn.__name__}: processes still running after {timeout} s")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "grad-cache"])
def test_two_gloo_processes_match_one_process(tiny_bert_dir, tmp_path, cached):
    enc = _encoder(tiny_bert_dir)
    tok = _views(enc, [(a, p, h) for (a, p), h in zip(PAIRS, NEGS)])
    loss = _objective()(enc(**tok).view(3, len(PAIRS), -1)).loss
    loss.backward()
    _spawn(_worker, (2, str(tiny_bert_dir), _free_port(), str(tmp_path), cached))
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        torch.testing.assert_close(got["loss"][0], loss.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["grad"], enc.prompt.prefix.grad, atol=1e-5, rtol=1e-5)


def _shutdown_worker(rank, world, port, out_dir):
    from fastprompt.train.distributed import init_distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    ctx = init_distributed("cpu")
    assert ctx.owns_group and ctx.enabled and torch.distributed.is_initialized()
    ddp = ctx.wrap(torch.nn.Linear(3, 1))
    ddp(torch.randn(2, 3)).sum().backward()  # one gradient all-reduce in flight on gloo's threads
    del ddp
    ctx.shutdown()
    assert not torch.distributed.is_initialized() and not ctx.owns_group
    ctx.shutdown()  # a second call is a no-op
    open(os.path.join(out_dir, f"done{rank}"), "w").close()


def test_shutdown_destroys_the_group_init_distributed_created(tmp_path):
    _spawn(_shutdown_worker, (2, _free_port(), str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done0", "done1"]


def test_shutdown_leaves_a_group_it_did_not_create_alone():
    ctx = DistributedContext(rank=0, world_size=2)  # e.g. a group the user initialised
    assert not ctx.owns_group
    ctx.shutdown()  # must not try to destroy anything

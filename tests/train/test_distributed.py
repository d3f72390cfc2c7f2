"""Two gloo processes on CPU give the same loss and prompt gradients as one process on the global batch."""
import os
import socket

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


def _worker(rank, world, model_dir, port, out_dir, cached):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
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
    finally:
        torch.distributed.destroy_process_group()


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
    mp.spawn(_worker, args=(2, str(tiny_bert_dir), _free_port(), str(tmp_path), cached), nprocs=2, join=True)
    for rank in range(2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        torch.testing.assert_close(got["loss"][0], loss.detach(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got["grad"], enc.prompt.prefix.grad, atol=1e-5, rtol=1e-5)

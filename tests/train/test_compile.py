"""``compile: true`` (torch.compile of the encoder): the same losses and prompt gradients as eager, and the
trainer's config key turns it on.

Tolerance: the compiled graph runs the same fp32 matrix products (Inductor leaves them to the same aten/BLAS
kernels on CPU) but fuses the elementwise chains and re-associates the reductions of LayerNorm, softmax and the
loss's norms: a few float32 ulps (~1e-7 relative) per op. The loss is a direct function of those values: 1e-5.
A prompt gradient entry is a sum over every token, view and layer of contributions that largely cancel (the
entries are ~1e-5 while the per-token terms they sum are orders larger), so its error is relative to those
terms, not to the entry: bounded here by 1e-4 x the largest |entry| of the same gradient (a real bug, e.g. a
dropped path or a wrong mask, moves the gradient by O(1) of its size).
"""
import shutil

import pytest
import torch

from fastprompt.data import Collator
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method, SimCSE
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.steps import LossSide, PlainStep

SENTENCES = [("a man plays the guitar .",), ("the dog runs in the park",), ("two people sit at a table",),
             ("it",), ("a woman is eating food",)]


def _compile_unavailable():
    if not hasattr(torch, "compile"):
        return "this torch has no torch.compile"
    if not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "torch.compile's CPU backend (Inductor) needs a C++ compiler; none (c++, g++, clang++) is on PATH"
    return None


needs_compile = pytest.mark.skipif(_compile_unavailable() is not None, reason=str(_compile_unavailable()))


def _loss_and_grad(model_dir, compiled):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3), pooler="cls",
                                        mlp="none")
    enc.eval()  # dropout off: both sides must then compute the same function
    if compiled:
        enc.compile()
    step = PlainStep(LossSide(Method(SimCSE(temperature=0.05), []), enc, DistributedContext()))
    loss = step(Collator(enc.tokenize, 16)(SENTENCES), step=0, seed=0).loss
    return loss, {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}


@pytest.mark.slow  # compiling the forward and the backward takes 1-2 minutes on 2 cores
@needs_compile
def test_compiled_encoder_matches_eager(tiny_bert_dir):
    eager_loss, eager_grads = _loss_and_grad(tiny_bert_dir, compiled=False)
    loss, grads = _loss_and_grad(tiny_bert_dir, compiled=True)
    assert loss == pytest.approx(eager_loss, rel=1e-5, abs=1e-5)
    assert grads.keys() == eager_grads.keys() and any("prompt" in n for n in grads)
    for name, want in eager_grads.items():
        assert want.abs().max() > 0, name
        atol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(grads[name], want, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_compile_key_compiles_the_trainers_encoder(base_config):
    from fastprompt.train import Trainer

    for compile_ in (False, True):
        trainer = Trainer(base_config(compile=compile_, max_steps=1))
        trainer.setup()
        # nn.Module.compile wraps the module in place (torch compiles lazily, at the first call)
        assert (getattr(trainer.encoder, "_compiled_call_impl", None) is not None) == compile_

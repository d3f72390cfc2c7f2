"""``compile`` (torch.compile of the encoder): the same losses and prompt gradients as eager in a training step,
a compiled run resumes bit for bit, the trainer's config key turns it on, and ``null`` (auto) resolves by the run's
size (fastprompt/train/compile.py).

The non-slow tests compile with torch.compile's ``aot_eager`` backend: Dynamo captures the graphs and AOTAutograd
traces forward and backward through the fused ops' fake implementations and registered autograd (what Inductor
receives), but the kernels run eagerly, so a test takes seconds instead of Inductor's minutes; the slow test
runs Inductor itself.

Tolerance: the compiled graph runs the same fp32 matrix products (Inductor leaves them to the same aten/BLAS
kernels on CPU) but fuses the elementwise chains and re-associates the reductions of LayerNorm, softmax and the
loss's norms: a few float32 ulps (~1e-7 relative) per op. The loss is a direct function of those values: 1e-5.
A prompt gradient entry is a sum over every token, view and layer of contributions that largely cancel (the
entries are ~1e-5 while the per-token terms they sum are orders larger), so its error is relative to those
terms, not to the entry: bounded here by 1e-4 x the largest |entry| of the same gradient (a real bug, e.g. a
dropped path or a wrong mask, moves the gradient by O(1) of its size).
"""
import csv
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.data import Collator
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method
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


def _loss_and_grad(model_dir, compiled, backend="inductor", train=False):
    """One PlainStep (forward of both views, fused loss, backward) with dropout off; ``train``: in training mode
    (train-only parts on, every dropout probability 0), else in eval mode."""
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(3, init_std=0.3), pooler="cls",
                                        mlp="train" if train else "none")
    if train:
        enc.train()
        for module in enc.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    else:
        enc.eval()  # dropout off: both sides must then compute the same function
    if compiled:
        enc.compile(backend=backend)
    step = PlainStep(LossSide(Method(SimCSE(temperature=0.05), []).train(train), enc, DistributedContext()))
    loss = step(Collator(enc.tokenize, 16)(SENTENCES), step=0, seed=0).loss
    return loss, {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}


def _assert_matches(loss, grads, eager_loss, eager_grads):
    assert float(loss) == pytest.approx(float(eager_loss), rel=1e-5, abs=1e-5)  # 0-d tensors: the step reads none
    assert grads.keys() == eager_grads.keys() and any("prompt" in n for n in grads)
    for name, want in eager_grads.items():
        assert want.abs().max() > 0, name
        atol = 1e-4 * want.abs().max().item()
        torch.testing.assert_close(grads[name], want, atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow  # compiling the forward and the backward takes 1-2 minutes on 2 cores
@needs_compile
def test_compiled_encoder_matches_eager(tiny_bert_dir):
    eager_loss, eager_grads = _loss_and_grad(tiny_bert_dir, compiled=False)
    loss, grads = _loss_and_grad(tiny_bert_dir, compiled=True)
    _assert_matches(loss, grads, eager_loss, eager_grads)


def test_compiled_training_step_matches_eager(tiny_bert_dir):
    """A training-mode step (the MLP head on, dropout probabilities 0) through Dynamo + AOTAutograd."""
    eager_loss, eager_grads = _loss_and_grad(tiny_bert_dir, compiled=False, train=True)
    loss, grads = _loss_and_grad(tiny_bert_dir, compiled=True, backend="aot_eager", train=True)
    _assert_matches(loss, grads, eager_loss, eager_grads)
    assert any("pooler" in n or "mlp" in n for n in grads)  # the train-only head took part


@pytest.fixture
def aot_eager_compile(monkeypatch):
    """The trainer's ``encoder.compile()`` with the aot_eager backend (see the module docstring)."""
    calls = []

    def compile_(self, *args, **kwargs):
        calls.append(self)
        return torch.nn.Module.compile(self, backend="aot_eager")

    monkeypatch.setattr(PromptEncoder, "compile", compile_)
    return calls


@pytest.mark.heavy  # torch.compile of a training run, twice: ~30 s
def test_compiled_run_resumes_bit_for_bit(base_config, aot_eager_compile, tmp_path):
    """Interrupted at step 3 and resumed, a compiled run (dropout on) ends with the same prompt and optimizer
    state as an uninterrupted one, bit for bit."""
    from fastprompt.train import Trainer

    cfg = base_config(compile=True, max_steps=6, save_steps=2, eval_steps=100, log_every=1, mlp="train",
                      prompt_dropout=0.1)
    ref = dict(cfg, output_dir=str(tmp_path / "ref"))
    assert Trainer(ref).train()["status"] == "completed"
    assert aot_eager_compile  # the trainer compiled its encoder

    def interrupt_at_step_3(trainer, out):
        if trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    run = dict(cfg, output_dir=str(tmp_path / "run"))
    assert Trainer(run, callbacks=[interrupt_at_step_3]).train()["global_step"] == 3
    assert Trainer(run).train()["global_step"] == 6
    for name in ("prompt.safetensors", "training_state.safetensors"):
        got, want = (load_file(str(tmp_path / d / "last" / name)) for d in ("run", "ref"))
        assert got.keys() == want.keys()
        for key in want:
            if name == "prompt.safetensors" or key.startswith("optimizer."):
                assert torch.equal(got[key], want[key]), f"{name}: {key} differs"


@pytest.mark.heavy  # torch.compile of a training run
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_compiled_run_traces_without_a_graph_break(base_config, aot_eager_compile, tiny_sts_dir, packed):
    """Issue 40, item 18: ``compile: true`` on the CPU printed 62 lines of torch._dynamo warnings (23 packed):
    fastprompt's code broke the graph ~40 times in a short run (a host read of the mask, the tokenizer's mask-id
    lookup, a ContextVar read in every layer, the C++ extension imported inside the traced forward), and the
    pieces recompiled past Dynamo's limit. A compiled run's steps, collapse probe and STS evaluations now trace
    whole. (Packed, without the STS evaluations: a packed forward takes the rows' host lengths, a list whose length
    Dynamo specialises, so each evaluation batch of another row count compiles again, as docs/speed.md says.)"""
    from torch._dynamo.utils import counters

    from fastprompt.train import Trainer

    torch._dynamo.reset()
    counters.clear()
    cfg = base_config(compile=True, packed=packed, max_steps=2, eval_steps=2,
                      sts_dir=None if packed else str(tiny_sts_dir))
    assert Trainer(cfg).train()["status"] == "completed"
    assert aot_eager_compile and dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] <= 6  # train and eval modes, static then dynamic shapes


@pytest.mark.heavy  # torch.compile of two training runs
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_compiled_lora_and_full_runs_trace_whole_and_train_like_eager(base_config, aot_eager_compile, no_dropout_bert,
                                                                      tiny_sts_dir, tmp_path, mode):
    """The tuning modes without a prompt (docs/tuning-modes.md) compile too: PEFT's LoRA layers and a trained
    backbone trace without a graph break, and the compiled run logs the eager run's losses (within this module's
    1e-5: the same fp32 function, other fusion) and trains the same weights (1e-5; with adam_epsilon 1 an AdamW step
    is lr * g / (|g| + 1), smooth in g, so gradients equal to rounding give weights equal to lr x that rounding,
    where the default epsilon's step, lr * sign(g) for a near-zero entry, can turn rounding into a lr-sized
    difference: measured 1e-4 on one of 256 entries). Dropout off (the model's and LoRA's): a compiled graph draws
    its dropout masks from another random stream than eager code."""
    from torch._dynamo.utils import counters

    from fastprompt.train import Trainer

    mode_keys = (dict(lora=True, lora_learning_rate=1e-2, lora_dropout=0.0) if mode == "lora" else
                 dict(train_backbone=True, backbone_learning_rate=1e-3))
    keys = dict(model=str(no_dropout_bert), prompt_type="none", adam_epsilon=1.0, max_steps=3, eval_steps=3,
                log_every=1, sts_dir=str(tiny_sts_dir), **mode_keys)
    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compiled in (False, True):
        out = tmp_path / ("compiled" if compiled else "eager")
        assert Trainer(base_config(compile=compiled, output_dir=str(out), **keys)).train()["status"] == "completed"
        runs[compiled] = out
    assert len(aot_eager_compile) == 1 and dict(counters["graph_break"]) == {}
    losses = [[float(r["loss"]) for r in csv.DictReader((runs[c] / "train_log.csv").read_text().splitlines())
               if r.get("loss")] for c in (False, True)]
    assert len(losses[0]) == 3
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    name = "adapter_model.safetensors" if mode == "lora" else "model.safetensors"
    eager, compiled = (load_file(str(runs[c] / "last" / name)) for c in (False, True))
    assert eager.keys() == compiled.keys() and eager
    base = load_file(str(no_dropout_bert / "model.safetensors"))
    moved = [k for k in eager
             if (".lora_B" in k and eager[k].any()) or (k in base and not torch.equal(eager[k], base[k]))]
    assert moved  # the runs trained the weights they compare
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], atol=1e-5, rtol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_compile_key_compiles_the_trainers_encoder(base_config):
    from fastprompt.train import Trainer

    for compile_ in (False, True, None):  # null (auto): a run this small stays eager
        trainer = Trainer(base_config(compile=compile_, max_steps=1))
        trainer.setup()
        # nn.Module.compile wraps the module in place (torch compiles lazily, at the first call)
        assert (getattr(trainer.encoder, "_compiled_call_impl", None) is not None) == bool(compile_)


def test_auto_compiles_only_cpu_runs_with_enough_work(base_config, tiny_bert_dir):
    from transformers import AutoConfig

    from fastprompt.train import TrainConfig
    from fastprompt.train.compile import AUTO_MIN_RUN_FLOPS, estimated_run_flops, resolve_compile
    from fastprompt.train.flops import step_flops

    minilm_like = AutoConfig.for_model("bert", hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                       num_attention_heads=12)
    # the decision counts with the training-step benchmark's count (bench/results/train_step_cpu.csv: 175.42 GFLOP
    # at 64 pairs x 32 tokens, P = 16), for batch_size x 2 views of max_length tokens per step
    cfg = TrainConfig(**base_config(batch_size=64, max_length=32, prompt_length=16, prompt_dropout=0.1))
    assert round(estimated_run_flops(cfg, minilm_like, 1) / 1e9, 2) == 175.42
    assert estimated_run_flops(cfg, minilm_like, 3) == 3 * step_flops(minilm_like, 32, 16, rows=128).total

    class Encoder:  # what resolve_compile reads of an encoder
        class backbone:
            config = minilm_like

    per_step = estimated_run_flops(cfg, minilm_like, 1)
    enough = int(AUTO_MIN_RUN_FLOPS // per_step) + 1
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile(cfg, Encoder, cpu, enough)
    assert not resolve_compile(cfg, Encoder, cpu, enough, packed=True)  # packing gains more: eager
    assert not resolve_compile(cfg, Encoder, cpu, enough - 1)
    assert not resolve_compile(cfg, Encoder, cuda, 10 * enough)  # not measured on GPUs: eager
    # without prompt dropout the eager CPU step is as fast as the compiled one: eager however long the run
    assert not resolve_compile(TrainConfig(**base_config(batch_size=64, max_length=32, prompt_length=16)),
                               Encoder, cpu, 10 * enough)
    for setting in (True, False):  # an explicit value is kept
        cfg.run.compile = setting
        assert resolve_compile(cfg, Encoder, cpu, 1) is setting and resolve_compile(cfg, Encoder, cuda, 1) is setting
        assert resolve_compile(cfg, Encoder, cpu, 1, packed=True) is setting
    # the suite's runs (tiny model, a few steps) resolve to eager
    tiny = TrainConfig(**base_config())
    assert tiny.run.compile is None
    assert not resolve_compile(tiny, type("E", (), {"backbone": type("B", (), {
        "config": AutoConfig.from_pretrained(tiny_bert_dir)})}), cpu, 10_000)


def test_auto_decides_on_the_runs_total_steps_also_on_resume(base_config, tmp_path, monkeypatch):
    """compile: null resolves from the run's total steps, not the steps left: a run resumed near its end compiles
    exactly when the uninterrupted one did (compiled and eager steps draw different dropout masks)."""
    import fastprompt.train.compile as compile_module
    from fastprompt.train import Trainer

    seen = []
    real = compile_module.resolve_compile
    monkeypatch.setattr(compile_module, "resolve_compile",
                        lambda cfg, enc, dev, steps, **kw: seen.append(steps) or real(cfg, enc, dev, steps, **kw))

    def interrupt_at_step_3(trainer, out):
        if trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    run = base_config(max_steps=5, save_steps=2, eval_steps=100, output_dir=str(tmp_path / "run"))
    assert Trainer(run, callbacks=[interrupt_at_step_3]).train()["global_step"] == 3
    assert Trainer(run).train()["global_step"] == 5
    assert seen == [5, 5]


def test_dynamos_recompile_limit_warning_is_one_line(caplog):
    """Issue 40, item 18: past the recompile limit (a packed encoder compiles a graph per batch row count) Dynamo
    warned in five lines and a link; a compiled encoder's run says it in one."""
    import logging

    from fastprompt.train.compile import DYNAMO_LOGGER, compile_encoder

    compile_encoder(torch.nn.Identity())
    compile_encoder(torch.nn.Identity())  # the filter is installed once
    log = logging.getLogger(DYNAMO_LOGGER)
    with caplog.at_level(logging.WARNING, logger=DYNAMO_LOGGER):
        # the call in torch/_dynamo/convert_frame.py (torch 2.13)
        log.warning("torch._dynamo hit config.%s (%s)\n   function: %s\n   last reason: %s\nTo log all recompilation "
                    'reasons, use TORCH_LOGS="recompiles".\nTo diagnose recompilation issues, see %s',
                    "recompile_limit", 8, "'forward' (fastprompt/model/encoder.py:285)",
                    "0/5: len(lengths) == 128        # if lengths is not None and len(lengths) != ...", "https://x")
        log.warning("another %s", "warning")
    first, other = (r.getMessage() for r in caplog.records)
    assert first == ("torch.compile: 'forward' (fastprompt/model/encoder.py:285) reached config.recompile_limit (8 "
                     "graphs; the last for 0/5: len(lengths) == 128): inputs of further shapes run it eagerly (a "
                     "packed encoder compiles a graph per batch row count); TORCH_LOGS=recompiles lists each")
    assert other == "another warning" and sum(isinstance(f, type(log.filters[-1])) for f in log.filters) == 1

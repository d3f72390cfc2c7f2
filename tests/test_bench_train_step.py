"""bench/bench_train_step.py on the tiny BERT: every side (the compiled one too, marked slow) computes the same
loss, and a run writes every point (its FLOP count is the library's, tested in tests/train/test_flops.py), with
the matmul rates measured in its timing process and a profile in ms that adds up.

Loss tolerance: both sides run the same fp32 model on the same tokens with the same prefix values and positions;
they differ in how attention is computed (fastprompt's fused op over prefix + tokens vs SDPA over the
concatenation) and in the loss kernel, i.e. in summation order only: a few float32 ulps through 2 layers of
O(1) activations, amplified by 1 / temperature = 20 in the logits: ~1e-5 on a loss of order 1; 1e-4 leaves margin.
"""
import csv
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_train_step.py"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_train_step", BENCH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH.parent))
    return module


def _config(model_dir, **kw):
    return dict(dict(model=str(model_dir), corpus=None, pairs=6, seq=12, prompt_length=3, dropout=0.1,
                     device="cpu"), **kw)


def _losses(bench, provider, model_dir, **kw):
    """A side's timed-step loss and its check's dropout-free loss at the starting parameters (after two steps
    have moved them: the check restores them)."""
    step = bench.setup(provider, **_config(model_dir, **kw))
    step()
    loss = step()["loss"]
    return loss, step.check()["loss_nodrop"]


@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_both_sides_compute_the_same_loss(bench, tiny_bert_dir, padding):
    """fastprompt packed (the trainer's default) and padded, and PEFT, on a batch padded to its longest sentence
    (the real corpus: lengths differ) or to exactly ``seq``."""
    pytest.importorskip("peft")
    corpus = str(bench.DEFAULT_CORPUS) if bench.DEFAULT_CORPUS.is_file() else None
    kw = dict(corpus=corpus, seq=40, padding=padding)
    ours, ours_nodrop = _losses(bench, "fastprompt", tiny_bert_dir, **kw)
    _, padded_nodrop = _losses(bench, "fastprompt_padded", tiny_bert_dir, **kw)
    theirs, theirs_nodrop = _losses(bench, "peft", tiny_bert_dir, **kw)
    assert ours_nodrop == pytest.approx(theirs_nodrop, abs=1e-4, rel=1e-4)
    assert padded_nodrop == pytest.approx(theirs_nodrop, abs=1e-4, rel=1e-4)
    assert ours_nodrop > 0.1  # a real in-batch loss (log 6 = 1.8 at random), not a degenerate one
    # the timed steps train (dropout on, lr 1e-2): finite losses, each side's own draws
    assert math.isfinite(ours) and math.isfinite(theirs)


@pytest.mark.parametrize("provider", ["fastprompt", "peft"])
def test_the_timed_steps_train_with_dropout_on(bench, tiny_bert_dir, provider, monkeypatch):
    """from_pretrained returns a model in eval mode: the timed steps must run in training mode, dropout on (an
    earlier version timed both sides with every dropout off). The embeddings' nn.Dropout runs on both sides."""
    pytest.importorskip("peft")
    step = bench.setup(provider, **_config(tiny_bert_dir))
    modes = []
    forward = torch.nn.Dropout.forward
    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda self, x: modes.append(self.training) or forward(self, x))
    step()
    assert modes and all(modes)


@pytest.fixture(scope="module")
def tiny_random_llama(bench, tiny_bert_dir, tmp_path_factory):
    """The decoder point's model (bench.random_llama) at a tiny size: 2 layers, hidden 32, 4 query heads and 2
    key/value heads, the tiny BERT's vocabulary."""
    return bench.random_llama(tmp_path_factory.mktemp("llama") / "random-llama", str(tiny_bert_dir), hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)


def test_decoder_sides_compute_the_same_loss(bench, tiny_random_llama):
    """The decoder point: last-token pooling, causal tokens, a prefix per key/value head on both sides; the same
    dropout-free loss (same tolerance and reasons as above: RMSNorm-normalised O(1) activations)."""
    pytest.importorskip("peft")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_random_llama)
    assert (config.model_type, config.num_key_value_heads, config.num_attention_heads) == ("llama", 2, 4)
    ours, ours_nodrop = _losses(bench, "fastprompt", tiny_random_llama)
    theirs, theirs_nodrop = _losses(bench, "peft", tiny_random_llama)
    assert ours_nodrop == pytest.approx(theirs_nodrop, abs=1e-4, rel=1e-4)
    assert ours_nodrop > 0.1
    assert abs(ours - ours_nodrop) < 1.0 and abs(theirs - theirs_nodrop) < 1.0


@pytest.mark.slow  # torch.compile of the tiny encoder's training and evaluation graphs: a minute or two
def test_compiled_side_computes_the_same_loss(bench, tiny_bert_dir):
    """The compiled provider's check compiles the evaluation graph and gives the eager loss (same tolerance: the
    compiled kernels change the summation order only)."""
    pytest.importorskip("peft")
    _, compiled = _losses(bench, "fastprompt_compiled", tiny_bert_dir)
    _, theirs = _losses(bench, "peft", tiny_bert_dir)
    assert compiled == pytest.approx(theirs, abs=1e-4, rel=1e-4)


def test_matmul_pseudo_providers_do_the_counted_work(bench, tiny_bert_dir):
    """The rate pseudo-providers run a product of the shape whose FLOPs the floor divides by their time."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_bert_dir)
    shapes = bench.matmul_shapes(cfg, 6, 12, 3)
    for name in bench.MATMULS:
        out = bench.setup(name, **_config(tiny_bert_dir, prompt_length=3))()
        (m, k), n = shapes[name][0][-2:], shapes[name][1][-1]
        assert out.shape[-2:] == (m, n) and shapes[name][2] == 2 * out.numel() * k
    assert shapes["matmul_attn"][0] == (2 * 6 * cfg.num_attention_heads, 12, cfg.hidden_size // 4)


@pytest.mark.heavy  # a bench smoke run: ~20 s
def test_bench_writes_every_point(bench, tiny_bert_dir, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "train_step.csv"
    proc = subprocess.run([sys.executable, str(BENCH), "--model", str(tiny_bert_dir), "--corpus", "none",
                           "--batches", "4,6", "--seq", "10", "--prompt-length", "2", "--repeats", "2",
                           "--providers", "fastprompt,peft", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["provider"], int(r["pairs"])) for r in rows] == [("fastprompt", 4), ("peft", 4), ("fastprompt", 6),
                                                                ("peft", 6)]
    for r in rows:
        assert r["bench"] == "train_step" and int(r["seq"]) == 10
        assert float(r["median_ms"]) > 0 and float(r["peak_mb"]) >= 0 and float(r["gflop"]) > 0
        assert 0 < float(r["gflop_real"]) <= float(r["gflop"])  # the generated sentences are 8-47 words
        assert int(r["padded_to"]) == 10 and r["padding"] == "longest"  # every sentence is cut at 10 tokens
        assert float(r["real_floor_fraction"]) <= float(r["floor_fraction"])
        assert float(r["matmul_gflops"]) > 0 and float(r["attn_matmul_gflops"]) > 0
        # the CSV rounds floor_fraction to 3 decimals, floor_ms to 3 and median_ms to 1: the fraction recomputed
        # from the rounded columns is off by at most 5e-4 + (5e-4 + fraction * 0.05) / median_ms
        floor, median = float(r["floor_ms"]), float(r["median_ms"])
        bound = 5e-4 + (5e-4 + floor / median * 0.05) / median
        assert abs(float(r["floor_fraction"]) - floor / median) <= bound * 1.01
        assert float(r["loss_nodrop_diff"]) < 1e-4
    assert {r["time_vs_baseline"] for r in rows if r["provider"] == "peft"} == {"1.0"}
    sidecar = json.loads(out.with_suffix(".json").read_text())
    profiles = sidecar["summary"]["profile_ms"]  # the first point only (the default --profile first)
    assert set(profiles) == {"fastprompt pairs=4 seq=10", "peft pairs=4 seq=10"}
    for ms in profiles.values():
        parts = {k: v for k, v in ms.items() if k != "step"}
        assert ms["matmul"] > 0 and bench.UNATTRIBUTED in parts
        # every category rounded to 0.1 ms: the sum is off the step's wall time by at most 0.05 ms each
        assert sum(parts.values()) == pytest.approx(ms["step"], abs=0.05 * len(parts) + 1e-6)


def test_the_cuda_graphs_provider_needs_a_gpu(bench):
    """``fastprompt_graphs`` (the trainer's cuda_graphs: true) replays CUDA graphs: asked for on the CPU it is
    refused before any work, and the CPU's default list leaves it out."""
    proc = subprocess.run([sys.executable, str(BENCH), "--providers", "fastprompt,fastprompt_graphs"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "fastprompt_graphs replays CUDA graphs: it needs --device cuda" in proc.stderr
    assert "fastprompt_graphs" in bench.PROVIDERS and bench.CUDA_ONLY == ("fastprompt_graphs",)


@pytest.mark.parametrize("provider,mode", [("fastprompt_lora", "lora"), ("fastprompt_full", "full")])
def test_the_other_tuning_modes_train_the_same_step(bench, tiny_bert_dir, provider, mode):
    """The LoRA and full fine-tuning sides: no prompt, packed like the trainer's, their own trainable parameters;
    at their starting parameters both are the frozen model without a prefix (LoRA's adapters start at zero), so
    their dropout-free losses agree (same tolerance as above: LoRA's zero update adds exact zeros)."""
    step = bench.setup(provider, **_config(tiny_bert_dir))
    losses = [step()["loss"] for _ in range(2)]
    check = step.check()
    assert all(math.isfinite(x) for x in losses)
    # tiny BERT: 2 layers of hidden 32, feed-forward 64; LoRA r=8 on query/key/value/dense (the BERT default)
    per_layer = 4 * 8 * (32 + 32) + 2 * 8 * (32 + 64)
    if mode == "lora":
        assert check["trainable_params"] == 2 * per_layer
    else:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(tiny_bert_dir)
        assert check["trainable_params"] == sum(p.numel() for n, p in model.named_parameters()
                                                if not n.startswith("pooler."))
    other = bench.setup("fastprompt_full" if mode == "lora" else "fastprompt_lora", **_config(tiny_bert_dir))
    assert check["loss_nodrop"] == pytest.approx(other.check()["loss_nodrop"], abs=1e-4, rel=1e-4)
    assert check["loss_nodrop"] > 0.1

"""bench/bench_train_step.py on the tiny BERT: both sides compute the same loss, the FLOP count matches what
torch's FLOP counter sees in the baseline's forward and backward, and a run writes every point.

Loss tolerance: both sides run the same fp32 model on the same tokens with the same prefix values and positions;
they differ in how attention is computed (fastprompt's fused op over prefix + tokens vs SDPA over the
concatenation) and in the loss kernel, i.e. in summation order only: a few float32 ulps through 2 layers of
O(1) activations, amplified by 1 / temperature = 20 in the logits: ~1e-5 on a loss of order 1; 1e-4 leaves margin.
"""
import csv
import importlib.util
import json
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


def test_both_sides_compute_the_same_loss(bench, tiny_bert_dir):
    pytest.importorskip("peft")
    ours = bench.setup("fastprompt", **_config(tiny_bert_dir))()
    theirs = bench.setup("peft", **_config(tiny_bert_dir))()
    assert ours["loss_nodrop"] == pytest.approx(theirs["loss_nodrop"], abs=1e-4, rel=1e-4)
    assert ours["loss_nodrop"] > 0.1  # a real in-batch loss (log 6 = 1.8 at random), not a degenerate one
    for side in (ours, theirs):  # the timed steps train with dropout: a finite loss near the dropout-free one
        assert abs(side["loss"] - side["loss_nodrop"]) < 1.0


def test_flop_count_matches_torch_flop_counter(bench, tiny_bert_dir):
    """step_flops' forward and backward against torch.utils.flop_counter on the baseline model (PEFT, eager
    attention so that the counter sees its products; frozen linear layers), dropout off. The counter sees every
    matmul, so matching it, up to the terms accounted for below, means the analysis left nothing out and counted
    no weight gradient."""
    peft = pytest.importorskip("peft")
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModel

    pairs, seq, P = 5, 9, 3
    cfg = AutoConfig.from_pretrained(tiny_bert_dir)
    model = peft.get_peft_model(AutoModel.from_pretrained(tiny_bert_dir, attn_implementation="eager"),
                                peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=P)).eval()
    ids = torch.randint(5, cfg.vocab_size, (2 * pairs, seq))
    with FlopCounterMode(display=False) as fwd:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    with FlopCounterMode(display=False) as bwd:
        out.backward(torch.randn_like(out))
    want = bench.step_flops(cfg, pairs, seq, P)
    rows, H = 2 * pairs, cfg.hidden_size
    # AutoModel also runs BERT's pooler (a dense layer on each [CLS]), which the [CLS]-vector loss never reads
    assert fwd.get_total_flops() == want["flops_forward"] + 2 * rows * H * H
    # autograd computes layer 0's dK and dV for the tokens' keys too (then drops them): 2 S^2 H per row
    assert bwd.get_total_flops() == want["flops_backward"] + 2 * rows * 2 * seq * seq * H


def test_bench_writes_every_point(tiny_bert_dir, tmp_path):
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
        # the CSV rounds floor_fraction to 3 decimals, floor_ms to 3 and median_ms to 1: the fraction recomputed
        # from the rounded columns is off by at most 5e-4 + (5e-4 + fraction * 0.05) / median_ms
        floor, median = float(r["floor_ms"]), float(r["median_ms"])
        bound = 5e-4 + (5e-4 + floor / median * 0.05) / median
        assert abs(float(r["floor_fraction"]) - floor / median) <= bound * 1.01
        assert float(r["loss_nodrop_diff"]) < 1e-4
    assert {r["time_vs_baseline"] for r in rows if r["provider"] == "peft"} == {"1.0"}
    sidecar = json.loads(out.with_suffix(".json").read_text())
    shares = sidecar["summary"]["profile_self_time_share"]
    assert set(shares) == {"fastprompt pairs=4 seq=10", "peft pairs=4 seq=10"}
    for s in shares.values():
        assert s["matmul"] > 0 and sum(s.values()) == pytest.approx(1.0, abs=0.02)

"""Smoke tests of the op benchmarks (contrastive loss, prefix attention, MLM logits) at the smallest sizes: every
provider is timed and measured and the CSV is in the harness's schema, with the bench's baseline at 1."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # bench smoke runs of the ops

BENCH = Path(__file__).resolve().parents[1] / "bench"
RUNS = {
    "bench_contrastive_loss.py": (["--smoke"], ["fused", "triton", "chunked", "torch_chunked", "reference"],
                                  "reference"),
    "bench_prefix_attention.py": (["--shapes", "4x8", "--prefix", "2", "--heads", "2", "--head-dim", "16",
                                   "--kv-heads", "1", "--causal", "--modes", "fwd+bwd", "--repeats", "2", "--warmup",
                                   "1"],
                                  ["fastprompt", "fastprompt_packed", "sdpa_concat", "eager_concat"], "sdpa_concat"),
    "bench_mlm_logits.py": (["--rows", "4", "--vocab", "500", "--hidden", "32", "--repeats", "2"],
                            ["masked", "full"], "full"),
}


@pytest.mark.parametrize("script", sorted(RUNS))
def test_op_bench_measures_every_provider(script, tmp_path):
    args, providers, baseline = RUNS[script]
    out = tmp_path / "out.csv"
    proc = subprocess.run([sys.executable, str(BENCH / script), *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [r["provider"] for r in rows] == providers
    for r in rows:
        assert r["device"] == "cpu" and float(r["median_ms"]) > 0 and int(r["repeats"]) == 2
        assert float(r["peak_mb"]) >= 0 and r["baseline"] == baseline
        assert float(r.get("max_abs_err_vs_sdpa") or 0) < 1e-5, r  # every provider computes the same attention
        if script == "bench_prefix_attention.py":  # the useful matrix work per second (no peak on the CPU)
            assert float(r["tflops"]) > 0 and r["peak_fraction"] == "", r
    assert next(r for r in rows if r["provider"] == baseline)["time_vs_baseline"] == "1.0"
    assert json.loads(out.with_suffix(".json").read_text())["command"].startswith(f"python bench/{script} ")


def test_the_loss_bench_measures_each_option_against_the_reference_with_it(tmp_path):
    """``--options``: simcse and each of the loss's options alone on top of it, the fused op and the reference
    with the same option, each option's row divided by its own reference (issue 40, item 21's per-option table)."""
    sys.path.insert(0, str(BENCH))
    import bench_contrastive_loss as bench

    out = tmp_path / "options.csv"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_contrastive_loss.py"), "--options", "--n", "24",
                           "--d", "16", "--repeats", "1", "--providers", "fused", "reference", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["loss"], r["provider"]) for r in rows] == [
        (loss, p) for loss in ["simcse", *bench.OPTIONS] for p in ("fused", "reference")]
    for r in rows:
        assert float(r["median_ms"]) > 0 and float(r["peak_mb"]) >= 0 and r["baseline"] == "reference"
        assert r["time_vs_baseline"] == "1.0" if r["provider"] == "reference" else float(r["time_vs_baseline"]) > 0

"""Smoke test of bench/bench_large_batch.py on the tiny BERT: every point trains, and the CSV / JSON say so."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a bench smoke run

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_large_batch.py"


def test_large_batch_bench_writes_every_point(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"sentence number {i} of the tiny corpus\n" for i in range(40)), encoding="utf-8")
    out = tmp_path / "large_batch.csv"
    subprocess.run([sys.executable, str(BENCH), "--model", str(tiny_bert_dir), "--corpus", str(corpus),
                    "--batches", "8,16", "--modes", "cache,plain", "--micro-batch-size", "4", "--steps", "2",
                    "--precision", "fp32", "--prompt-length", "2", "--max-length", "12", "--out", str(out)],
                   check=True, capture_output=True, text=True, timeout=600)
    rows = list(csv.DictReader(out.open()))
    assert [(r["provider"], int(r["global_batch"])) for r in rows] == [("cache", 8), ("cache", 16), ("plain", 8),
                                                                      ("plain", 16)]
    for r in rows:
        assert r["bench"] == "large_batch" and r["device"] == "cpu"
        assert r["status"] == "ok" and float(r["process_peak_mb"]) > 0 and float(r["time_per_sentence_ms"]) > 0
        assert int(r["steps"]) == 2 and float(r["loss"]) > 0 and int(r["tokens"]) > 0
        per_sentence = float(r["time_per_sentence_ms"])
        assert float(r["median_ms"]) == pytest.approx(per_sentence * int(r["global_batch"]), abs=0.1)  # rounding
    assert {r["micro_batch_size"] for r in rows if r["provider"] == "cache"} == {"4"}
    assert {r["time_vs_baseline"] for r in rows if r["provider"] == "cache"} == {"1.0"}
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["summary"]["largest_batch_within_budget"] == {"cache": 16, "plain": 16}
    assert "bench_large_batch.py" in sidecar["command"] and len(sidecar["rows"]) == 4

"""Smoke test of bench/bench_large_batch.py on the tiny BERT: every point trains, and the CSV / JSON say so."""
import csv
import json
import subprocess
import sys
from pathlib import Path

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
    assert [(r["mode"], int(r["global_batch"])) for r in rows] == [("cache", 8), ("cache", 16), ("plain", 8),
                                                                  ("plain", 16)]
    for r in rows:
        assert r["status"] == "ok" and float(r["peak_rss_gb"]) > 0 and float(r["time_per_sentence_ms"]) > 0
        assert int(r["steps"]) == 2 and float(r["loss"]) > 0
    assert {r["micro_batch_size"] for r in rows if r["mode"] == "cache"} == {"4"}
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["largest_batch_within_budget"] == {"cache": 16, "plain": 16}
    assert "bench_large_batch.py" in summary["command"] and len(summary["rows"]) == 4

"""Smoke test of bench/bench_ski_generation.py on a tiny random Llama: every batch size answers every sentence,
does the same work (greedy decoding: the same tokens at every batch size) and the CSV says so in the harness's
schema."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # a bench smoke run

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_ski_generation.py"


def test_ski_generation_bench_measures_every_batch_size(tiny_llama_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\na dog ran in the park\nwhat is it\nthe sentence\nyou know\n",
                      encoding="utf-8")
    out = tmp_path / "ski.csv"
    proc = subprocess.run([sys.executable, str(BENCH), "--model", str(tiny_llama_dir), "--input", str(corpus),
                           "--sentences", "5", "--batch-sizes", "1,4", "--max-new-tokens", "4", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["provider"], r["batch_size"]) for r in rows] == [("batch_1", "1"), ("batch_4", "4")]
    for r in rows:
        assert r["bench"] == "ski_generation" and r["device"] == "cpu" and r["sentences"] == "5"
        assert float(r["median_ms"]) > 0 and int(r["repeats"]) == 2 and float(r["peak_mb"]) >= 0
        assert 0 < int(r["tokens"]) <= 5 * 4 and float(r["tokens_per_s"]) > 0
    assert rows[0]["tokens"] == rows[1]["tokens"]  # greedy: the same answers at every batch size
    assert rows[0]["time_vs_baseline"] == "1.0" and rows[1]["baseline"] == "batch_1"
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["command"].startswith("python bench/bench_ski_generation.py ")
    assert len(sidecar["rows"]) == 2 and sidecar["machine"]["versions"]["torch"]

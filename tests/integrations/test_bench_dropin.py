"""Smoke tests of bench/bench_st_loss.py and bench/bench_peft_prefix.py: every provider is measured and the CSV and
JSON say so in the harness's schema (tiny sizes; the measurements themselves are in bench/results/ and
docs/dropin.md), and the tables of docs/dropin.md and docs/speed.md are those the committed results give."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
MEASURES = ("median_ms", "p20_ms", "p80_ms", "peak_mb", "baseline", "time_vs_baseline", "mem_vs_baseline")


def _run(script, out, *args):
    subprocess.run([sys.executable, str(BENCH / script), "--repeats", "1", "--threads", "1", "--out", str(out), *args],
                   check=True, capture_output=True, text=True, timeout=900)
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0])[:3] == ["bench", "device", "provider"] and all(m in rows[0] for m in MEASURES)
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["command"].startswith(f"python bench/{script} ") and len(summary["rows"]) == len(rows)
    assert [r["provider"] for r in summary["rows"]] == [r["provider"] for r in rows]
    return rows


@pytest.mark.heavy  # a bench smoke run
def test_st_loss_bench_measures_every_provider(tmp_path):
    pytest.importorskip("sentence_transformers")
    rows = _run("bench_st_loss.py", tmp_path / "st.csv", "--part", "loss", "--batch", "16", "--columns", "3")
    assert [r["provider"] for r in rows] == ["fastprompt", "mnrl", "cached_mnrl", "fastprompt_cached"]
    for r in rows:
        assert (r["bench"], r["part"], r["encoder"], r["batch"]) == ("st_loss", "loss", "", "16")
        assert float(r["median_ms"]) > 0 and float(r["peak_mb"]) >= 0 and float(r["time_vs_baseline"]) > 0
        assert r["baseline"] == "mnrl" and r["threads"] == "1"
    assert [float(r["time_vs_baseline"]) for r in rows][1] == 1.0


@pytest.mark.heavy  # a bench smoke run
def test_st_loss_step_with_the_small_encoder(tiny_bert_dir, tmp_path):
    """The step part's default encoder (a small random BERT with --model's tokenizer) on a few triplets, through
    sentence-transformers' GradCache (the cached provider) and the plain MNRL baseline."""
    pytest.importorskip("sentence_transformers")
    data = tmp_path / "triplets.csv"
    with data.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["sent0", "sent1", "hard_neg"])
        w.writerows([f"a man plays the guitar {i}", f"the man is playing {i}", f"a dog eats food {i}"]
                    for i in range(20))
    rows = _run("bench_st_loss.py", tmp_path / "step.csv", "--part", "step", "--batch", "8", "--model",
                str(tiny_bert_dir), "--data", str(data), "--providers", "fastprompt_cached", "mnrl")
    assert [(r["provider"], r["encoder"], r["batch"], r["columns"]) for r in rows] == [
        ("fastprompt_cached", "small", "8", "3"), ("mnrl", "small", "8", "3")]
    # the tiny model's step can fit in pages already resident: its RSS peak above the start is then 0 (page
    # granularity, allocator reuse), a true measurement; the process peak is always positive
    assert all(float(r["median_ms"]) > 0 and float(r["peak_mb"]) >= 0 and float(r["process_peak_mb"]) > 0
               for r in rows)


@pytest.mark.slow  # seven child processes each load the real MiniLM: minutes on a loaded machine
def test_peft_bench_measures_every_provider(tmp_path, shared_data, minilm_dir):
    pytest.importorskip("peft")
    # batch 8: the step's tensors are then above glibc's 64 KiB mmap threshold, so its peak shows (at batch 2 they
    # come from heap the warm-up already grew, and the peak reads as 0 +- 0.1 MiB)
    rows = _run("bench_peft_prefix.py", tmp_path / "peft.csv", "--batch", "8", "--projection", "off")
    assert [r["provider"] for r in rows] == ["peft", "fastprompt", "fastprompt_ckpt"]
    for r in rows:
        assert r["bench"] == "peft_prefix" and r["baseline"] == "peft"
        assert float(r["median_ms"]) > 0 and float(r["peak_mb"]) > 0 and float(r["mem_vs_baseline"]) > 0


def test_docs_tables_are_the_committed_results():
    proc = subprocess.run([sys.executable, str(BENCH / "docs_tables.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

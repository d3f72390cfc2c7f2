"""Smoke tests of bench/bench_st_loss.py and bench/bench_peft_prefix.py: every provider is measured and the CSV and
JSON say so (tiny sizes; the measurements themselves are in bench/results/ and docs/dropin.md), and the tables
of docs/dropin.md are those the committed results give."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _run(script, out, *args):
    subprocess.run([sys.executable, str(BENCH / script), "--repeats", "1", "--threads", "1", "--out", str(out), *args],
                   check=True, capture_output=True, text=True, timeout=900)
    rows = list(csv.DictReader(out.open()))
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["command"].startswith(f"python bench/{script} ") and len(summary["rows"]) == len(rows)
    assert [r["provider"] for r in summary["rows"]] == [r["provider"] for r in rows]
    return rows


def test_st_loss_bench_measures_every_provider(tmp_path):
    pytest.importorskip("sentence_transformers")
    rows = _run("bench_st_loss.py", tmp_path / "st.csv", "--part", "loss", "--batch", "16", "--columns", "3")
    assert [r["provider"] for r in rows] == ["fastprompt", "mnrl", "cached_mnrl", "fastprompt_cached"]
    for r in rows:
        assert r["part"] == "loss" and r["batch"] == "16" and float(r["median_s"]) > 0
        assert float(r["peak_extra_mb"]) >= 0 and float(r["time_vs_mnrl"]) > 0
    assert [float(r["time_vs_mnrl"]) for r in rows][1] == 1.0


@pytest.mark.slow  # seven child processes each load the real MiniLM: minutes on a loaded machine
def test_peft_bench_measures_every_provider(tmp_path, shared_data, minilm_dir):
    pytest.importorskip("peft")
    rows = _run("bench_peft_prefix.py", tmp_path / "peft.csv", "--batch", "2", "--projection", "off")
    assert [r["provider"] for r in rows] == ["peft", "fastprompt", "fastprompt_ckpt"]
    for r in rows:
        assert float(r["median_s"]) > 0 and float(r["peak_extra_mb"]) > 0 and float(r["mem_vs_peft"]) > 0


def test_docs_tables_are_the_committed_results():
    proc = subprocess.run([sys.executable, str(BENCH / "dropin_tables.py"), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

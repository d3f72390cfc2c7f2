"""bench/docs_tables.py renders what a results file holds: a training-step run in today's format (the profile in
ms, with the unattributed share, and both matmul rates) gives the tables docs/speed.md shows after a rerun; a
missing results file leaves "(not measured)"; the committed results give the committed docs (the --check test is
in tests/integrations/test_bench_dropin.py)."""
import importlib.util
import json
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench" / "docs_tables.py"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("docs_tables", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RESULTS", tmp_path)
    return module


def test_train_step_tables_in_todays_format(tables, tmp_path):
    row = dict(bench="train_step", device="cpu", provider="fastprompt_compiled", model="m", pairs=64, seq=32,
               prompt_length=16, median_ms=3907.3, p20_ms=1.0, p80_ms=2.0, peak_mb=426.9, baseline="peft",
               time_vs_baseline=0.607, mem_vs_baseline=0.616, floor_ms=884.1, floor_fraction=0.226, gflop=175.42,
               matmul_gflops=198.4, attn_matmul_gflops=61.25, loss_nodrop=1.3810571, loss_nodrop_diff=2e-6)
    profile = {"step": 4000.0, "matmul": 3000.0, "copy/cat/layout": 400.0, tables.UNATTRIBUTED: 600.0}
    machine = {"cpus": 2, "cpu": "AMD EPYC 7B13", "cpu_capability": "AVX2", "cpu_isa": "x86-64-v3"}
    (tmp_path / "train_step_cpu.json").write_text(json.dumps(
        {"command": "python bench/bench_train_step.py", "machine": machine, "rows": [dict(row, gflop_real=150.04)],
         "summary": {"profile_ms": {"fastprompt_compiled pairs=64 seq=32": profile}}}))
    table = tables.train_step_table()
    # speed-up = 1 / time_vs_baseline; an older row (no padded_to, no real-token floor) says what it lacks
    assert ("| 64 | 32 | 32 | fastprompt_compiled | 3907 | 1.65x | 427 | 0.62x | 884 | 0.23 | (not recorded) | "
            "1.381057 |") in table
    assert "198.4 GFLOP/s; at the attention's shape: 61.2 GFLOP/s" in table
    assert "Measured on 2 CPU cores: AMD EPYC 7B13, vector ISA: torch AVX2, fastprompt C++ x86-64-v3." in table
    assert "Per step: 175.4 GFLOP (150.0 of real tokens) at 64 pairs, 32 tokens." in table
    assert "fastprompt_compiled 2.0e-06 at 64 pairs, 32 tokens" in table
    lines = tables.profile_table().splitlines()
    assert lines[0].endswith(f"| other | {tables.UNATTRIBUTED} | step |")
    assert lines[2] == ("| fastprompt_compiled pairs=64 seq=32 | 3,000 | 0 | 0 | 0 | 0 | 0 | 400 | 0 | 0 | 0 | 600 "
                        "| 4,000 |")
    (tmp_path / "train_step_cpu.json").write_text(json.dumps(
        {"command": "c", "machine": machine, "rows": [dict(row, gflop_real=150.04, padded_to=27,
                                                           real_floor_fraction=0.31)]}))
    assert "| 64 | 32 | 27 | fastprompt_compiled | 3907 | 1.65x | 427 | 0.62x | 884 | 0.23 | 0.31 | " in \
        tables.train_step_table()


def test_missing_results_are_not_measured(tables):
    assert tables.train_step_table() == tables.profile_table() == tables.peft_table() == "(not measured)"
    assert tables.st_table(tables.ST_STEP) == "(not measured)"


def test_st_step_table_names_the_encoder(tables, tmp_path):
    rows = [dict(bench="st_loss", device="cpu", provider=p, part="step", encoder="small", batch=4096, columns=3,
                 median_ms=12345.6, peak_mb=10.0, baseline="mnrl", time_vs_baseline=r, mem_vs_baseline=r, threads=1)
            for p, r in (("mnrl", 1.0), ("fastprompt", 0.5))]
    (tmp_path / "st_loss_cpu_step.json").write_text(json.dumps(
        {"command": "python bench/bench_st_loss.py --part step", "rows": rows, "summary": {},
         "machine": {"versions": {"torch": "2"}, "cpus": 2, "cpu": "X", "loadavg_at_start": [1.25, 1, 1]}}))
    table = tables.st_table(tables.ST_STEP)
    assert "| small (2 layers, hidden 64) | 4,096 | 3 | fastprompt MNRL | 12,346 | 0.50 | 10.0 | 0.50 |" in table
    assert table.index("fastprompt MNRL") < table.index("sentence-transformers MNRL")
    # a result written before the harness recorded the vector ISA says so
    assert ("one torch thread per process on 2 CPU cores (X, vector ISA unknown (not recorded by that run); load "
            "average 1.2 when the run started)") in table

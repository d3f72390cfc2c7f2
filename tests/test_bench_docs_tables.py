"""bench/docs_tables.py renders what a results file holds: the step table names the encoder and the machine; a
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


def test_missing_results_are_not_measured(tables):
    assert tables.peft_table() == "(not measured)"
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
    assert "one torch thread per process on 2 CPU cores (X, load average 1.2 when the run started)" in table

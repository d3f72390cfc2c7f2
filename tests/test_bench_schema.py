"""Every benchmark measures and writes through bench/_harness.py, and every committed result is in its one schema.

The scripts are read, not run (their smoke tests run them): each defines the module-level ``setup`` the harness's
child processes call, measures with ``run_fresh`` and writes with ``write_results``, and writes no file of its own.
The committed CSVs start with the harness's leading columns, hold its measured columns in order after the
configuration, and match their JSON sidecars (the command, the machine, the rows).
"""
import ast
import csv
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import _harness  # noqa: E402

SCRIPTS = sorted(BENCH.glob("bench_*.py"))
RESULTS = sorted(_harness.RESULTS.glob("*.csv"))


def test_there_is_something_to_check():
    assert len(SCRIPTS) >= 8 and len(RESULTS) >= 6


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bench_measures_and_writes_through_the_harness(script):
    tree = ast.parse(script.read_text(encoding="utf-8"))
    from_harness = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "_harness"
                    for a in n.names}
    assert {"run_fresh", "write_results"} <= from_harness, f"{script.name} must time and write with _harness"
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"run_fresh", "write_results"} <= called
    assert any(isinstance(n, ast.FunctionDef) and n.name == "setup" for n in tree.body), "no module-level setup()"
    writes = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr in ("DictWriter", "writer", "write_text", "dump")]
    assert not writes, f"{script.name} writes a file itself (line {writes[0].lineno if writes else ''})"
    # the harness's forked children import the starting script again (multiprocessing): its work must run under
    # __main__ only, never at import
    guards = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "__name__ == '__main__'"]
    calls = [n for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    assert guards and not calls, f"{script.name} must run its work under if __name__ == '__main__' only"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_committed_results_are_in_the_harness_schema(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = reader.fieldnames, list(reader)
    assert tuple(header[:3]) == _harness.LEADING
    start = header.index(_harness.MEASURES[0])
    assert tuple(header[start:start + len(_harness.MEASURES)]) == _harness.MEASURES
    config = header[3:start]
    assert config, "no configuration columns"
    sidecar = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    assert sidecar["command"].startswith("python bench/bench_") and set(sidecar) == {"command", "machine", "summary",
                                                                                      "rows"}
    assert len(sidecar["rows"]) == len(rows) and rows
    for row, side in zip(rows, sidecar["rows"]):
        assert row == {k: "" if side.get(k) is None else str(side[k]) for k in header}
        assert row["bench"] and row["provider"]
        if row.get("note", "").startswith("skipped"):
            # a provider the harness did not run (e.g. the reference past --max-ref-gb) says why, and measures nothing
            assert all(row[k] == "" for k in _harness.MEASURES if k != "baseline")
            continue
        assert float(row["median_ms"]) > 0
        assert row["baseline"] and (row["time_vs_baseline"] == "" or float(row["time_vs_baseline"]) > 0)

"""bench/_harness.py: alternating timing, the fresh-process peak-memory method, the watchdog, the results schema.

The memory test allocates a known amount in a child process and checks that the harness sees it (and not
what was live before the step), which is what every bench's ``peak_mb`` relies on.
"""
import csv
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _harness  # noqa: E402

SCRIPT = textwrap.dedent('''
    import time

    HELD = []

    def setup(provider, mb=0, hold_s=0.0):
        HELD.append(bytearray(b"\\x01") * (32 << 20))  # live before the step: must not count

        def step():
            block = bytearray(b"\\x01") * (mb << 20)  # every page written, so resident
            time.sleep(hold_s)
            if provider == "fail":
                raise ValueError("this provider fails")
            return {"touched": len(block) >> 20}

        def check():  # untimed, after the measured steps, outside the peak
            bytearray(b"\\x01") * (2 * mb << 20)
            return {"checked": provider}

        step.check = check
        return step
''')


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "bench_toy.py"
    path.write_text(SCRIPT)
    return path


def test_timing_summary_and_alternation():
    t = _harness.Timing.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (t.median_ms, t.repeats) == (3.0, 5) and t.p20_ms == pytest.approx(1.8) and t.p80_ms == pytest.approx(4.2)
    assert _harness.Timing.of([2.0]) == _harness.Timing(2.0, 2.0, 2.0, 1, {})
    order = []
    timings = _harness.time_alternating({"a": lambda: order.append("a"), "b": lambda: {"n": len(order)}},
                                        warmup=1, repeats=3)
    assert order == ["a"] * 4  # one warm-up round, then the providers in turn every round
    assert set(timings) == {"a", "b"} and all(t.repeats == 3 for t in timings.values())
    assert timings["a"].extra == {} and timings["b"].extra == {"n": 4}  # what the last timed call returned
    with pytest.raises(ValueError, match="repeats"):
        _harness.time_alternating({"a": lambda: None}, repeats=0)


@pytest.fixture(params=["forked", "interpreter"])
def child_kind(request, monkeypatch):
    """Both kinds of child: forked from the preloaded server (every CPU run) and a new interpreter (CUDA runs,
    here on the CPU)."""
    if request.param == "interpreter":
        monkeypatch.setattr(_harness, "_Forked", lambda spec, preload: _harness._Interpreter(spec))
    return request.param


@pytest.mark.heavy  # a bench smoke run in fresh processes
def test_fresh_process_peak_memory_counts_the_step_only(script, child_kind):
    big = _harness.run_fresh(script, "setup", {"mb": 96}, mode="memory", providers=["toy"], device="cpu", steps=2)
    small = _harness.run_fresh(script, "setup", {"mb": 0}, mode="memory", providers=["toy"], device="cpu")
    assert big["status"] == "ok" and big["exact_peak"] and len(big["times_ms"]) == 2
    assert big["extra"] == {"touched": 96, "checked": "toy"}  # the check ran; its 192 MiB are not in the peak
    # 96 MiB written in the step; RSS also moves with the interpreter's own small allocations and frees
    # (under 1 MiB down, a few MiB up: measured -0.1 MiB here), far below the block's size
    assert 95 <= big["peak_mb"] < 104, big
    assert small["peak_mb"] < 8, small
    # the 32 MiB held before the step are in the process peak, not in the step's peak
    assert big["process_peak_mb"] >= big["peak_mb"] + 32


def test_fresh_process_timing_watchdog_and_failures(script, child_kind):
    timings = _harness.run_fresh(script, "setup", {"mb": 1}, mode="time", providers=["x", "y"], device="cpu",
                                 warmup=0, repeats=3)
    assert set(timings) == {"x", "y"} and timings["x"].repeats == 3 and timings["x"].median_ms > 0
    assert timings["y"].extra == {"touched": 1}  # the time process runs no check
    killed = _harness.run_fresh(script, "setup", {"mb": 400, "hold_s": 30}, mode="memory", providers=["toy"],
                                device="cpu", kill_above_mb=200)
    assert killed["status"] == "killed above 200 MB" and killed["process_peak_mb"] > 200
    with pytest.raises(RuntimeError, match="this provider fails"):
        _harness.run_fresh(script, "setup", {}, mode="memory", providers=["fail"], device="cpu")
    with pytest.raises(ValueError, match="one provider per process"):
        _harness.run_fresh(script, "setup", {}, mode="memory", providers=["x", "y"], device="cpu")


def test_results_schema_ratios_and_sidecar(tmp_path):
    rows = [dict(bench="toy", device="cpu", provider=p, n=n, median_ms=ms, peak_mb=mb, note=note)
            for p, n, ms, mb, note in [("fused", 1, 1.0, 2.0, ""), ("reference", 1, 4.0, 8.0, "x"),
                                       ("fused", 2, 3.0, 1.0, "")]]
    _harness.add_ratios(rows, "reference", ["n"])
    assert (rows[0]["time_vs_baseline"], rows[0]["mem_vs_baseline"]) == (0.25, 0.25)
    assert rows[1]["time_vs_baseline"] == 1.0 and rows[2]["time_vs_baseline"] is None  # no baseline at n=2
    info = {"threads": 2, "cpu": "Toy CPU", "cpu_capability": "AVX2"}  # no cpu_isa: the C++ kernels not built
    out = _harness.write_results(rows, tmp_path / "toy_cpu.csv", ["n"], info=info, summary={"k": 1})
    with open(out) as fh:
        header, *lines = list(csv.reader(fh))
    assert header == ["bench", "device", "provider", "n", *_harness.MEASURES, "note", *_harness.CPU_FIELDS]
    assert {tuple(line[-3:]) for line in lines} == {("Toy CPU", "AVX2", "")}  # every row names its CPU
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["machine"] == info and sidecar["summary"] == {"k": 1} and len(sidecar["rows"]) == 3
    assert _harness.results_path("toy", "cuda") == _harness.RESULTS / "toy_cuda.csv"
    table = _harness.markdown_table(rows, ["provider", "median_ms", "time_vs_baseline"])
    assert table.splitlines()[2] == "| fused | 1 | 0.25 |"
    assert sidecar["command"].startswith("python ")
    assert not list(tmp_path.glob(".*tmp*"))  # written through temporary files, replaced atomically


def test_measured_columns_and_machine(monkeypatch):
    t = _harness.Timing(1.23456, 1.0, 2.0, 5)
    mem = {"peak_mb": 12.345, "process_peak_mb": 600.04, "exact_peak": False}
    assert _harness.measured(t, mem, ndigits=2) == {
        "median_ms": 1.23, "p20_ms": 1.0, "p80_ms": 2.0, "repeats": 5, "peak_mb": 12.3, "process_peak_mb": 600.0,
        "note": "peak not resettable: the process's high-water mark"}
    assert _harness.measured(memory=dict(mem, exact_peak=True)) == {"peak_mb": 12.3, "process_peak_mb": 600.0}
    info = _harness.machine(("pytest", "no-such-package-here"))
    assert info["versions"]["pytest"] == pytest.__version__ and info["versions"]["no-such-package-here"] is None
    assert "versions" not in _harness.machine()
    # the vector ISA the run uses: torch's kernels' level, and fastprompt's C++ kernels' where built
    assert info["cpu"] and info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    from fastprompt.ops import _cpp, attention_cpu
    assert info["cpu_isa"] == (attention_cpu.isa() if _cpp.available() else None)
    monkeypatch.setattr(sys, "argv", [str(_harness.ROOT / "bench" / "bench_x.py"), "--n", "a b"])
    assert _harness.command_line() == "python bench/bench_x.py --n 'a b'"
    monkeypatch.setattr(sys, "argv", ["/elsewhere/script.py", "-q"])
    assert _harness.command_line() == "python /elsewhere/script.py -q"

"""The timing and memory harness every benchmark in bench/ uses (API and method: docs/benchmarks.md).

Time: :func:`time_alternating` runs the providers of one point in turn, round after round, in one process
(a fresh one, through :func:`run_fresh`), so a change of load on a shared machine hits them alike; it
reports the median and the 20th/80th percentiles.

Memory: :func:`run_fresh` with ``mode="memory"`` runs one provider in a fresh process and measures the peak
memory of its step above what was live before it. CPU: the peak resident set size (``VmHWM``, reset
through ``/proc/self/clear_refs`` just before the step) minus the resident size before it, with glibc told
to serve every allocation of 64 KiB or more by ``mmap`` and to return it on ``free``, so that freed
warm-up buffers cannot hide the step's allocations. CUDA: ``torch.cuda.max_memory_allocated`` after a
reset. Both count everything the step allocates (library workspaces and the C++ kernels' buffers too).

Results: one CSV schema (:data:`LEADING` columns, the bench's configuration columns, :data:`MEASURES`, then
bench-specific extras) in :data:`RESULTS`, with a JSON sidecar that records the command and the machine.

A bench script defines ``setup(provider, **config) -> step`` at module level (build the inputs, run one
tiny step to load the libraries, return a zero-argument callable that runs one measured step; the step may
return a dict of extra columns, and may carry a ``check`` attribute: an untimed callable the memory process
runs once after the measured steps, whose dict joins the extras) and, under ``if __name__ == "__main__"``
(the child process imports the script), calls :func:`run_fresh` with its own path and that function's name,
then :func:`write_results`. Every ``bench/bench_*.py`` works this way (tests/test_bench_schema.py).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fastprompt.io import atomic_file, write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
#: Where every bench writes its results (committed: the docs' tables are made from them).
RESULTS = ROOT / "bench" / "results"
#: The first columns of every results CSV, then the bench's configuration columns, then :data:`MEASURES`.
LEADING = ("bench", "device", "provider")
#: Measured columns: time (ms), peak memory of the step above what was live before it (MiB), and the ratios
#: against the bench's baseline provider at the same configuration (provider / baseline: < 1 is better).
MEASURES = ("median_ms", "p20_ms", "p80_ms", "peak_mb", "baseline", "time_vs_baseline", "mem_vs_baseline")
#: glibc settings of every memory process (see the module docstring).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


@dataclass
class Timing:
    """Summary of one provider's timed steps, in milliseconds, and what its last timed step returned (when a
    dict: e.g. the loss, or the tokens a step produced)."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, times_ms: list[float], extra: dict | None = None) -> "Timing":
        if not times_ms:
            raise ValueError("no timed steps")
        q = statistics.quantiles(times_ms, n=5, method="inclusive") if len(times_ms) > 1 else [times_ms[0]] * 4
        return cls(statistics.median(times_ms), q[0], q[3], len(times_ms), dict(extra or {}))


def device_sync(device: str) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


def time_alternating(calls: dict[str, Callable[[], object]], *, warmup: int = 1, repeats: int = 10,
                     sync: Callable[[], None] = lambda: None) -> dict[str, Timing]:
    """Time every call: ``warmup`` untimed rounds, then ``repeats`` rounds that each run every provider once,
    in turn. Returns each provider's :class:`Timing` (with the dict its last call returned, if any)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        for call in calls.values():
            call()
    sync()
    times: dict[str, list[float]] = {name: [] for name in calls}
    extras: dict[str, dict] = {name: {} for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            t0 = time.perf_counter()
            out = call()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
            if isinstance(out, dict):
                extras[name] = out
    return {name: Timing.of(ts, extras[name]) for name, ts in times.items()}


# ------------------------------------------------------------------------------------------------ memory
def _status_kb(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current VmRSS
        return True
    except OSError:
        return False


def measure_steps(step: Callable[[], object], device: str, steps: int = 1) -> dict:
    """Run ``step`` ``steps`` times in this process and measure its peak memory and the time of each run.

    Returns ``peak_mb`` (peak above what was live before the first step), ``process_peak_mb`` (the peak
    itself: resident memory of the whole process on CPU, all allocated tensors on CUDA), ``exact_peak``
    (False when the CPU peak could not be reset, so it covers the process's whole life), ``times_ms`` and
    ``extra`` (what the last step returned, when a dict, updated with what ``step.check()`` returns: an
    untimed check run once after the measured steps, outside the peak).
    """
    sync = device_sync(device)
    cuda = device.startswith("cuda")
    sync()
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()
        base, exact = torch.cuda.memory_allocated(), True
    else:
        base, exact = _status_kb("VmRSS") * 1024, _reset_peak_rss()
    times, out = [], None
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kb("VmHWM") * 1024
    extra = dict(out) if isinstance(out, dict) else {}
    check = getattr(step, "check", None)
    if check is not None:
        extra.update(check())
    return {"peak_mb": (peak - base) / 2**20, "process_peak_mb": peak / 2**20, "exact_peak": exact,
            "times_ms": times, "extra": extra}


# ------------------------------------------------------------------------------------------------ processes
def run_fresh(script: str | Path, setup: str, config: dict, *, mode: str, providers: Iterable[str], device: str,
              warmup: int = 1, repeats: int = 10, steps: int = 1, timeout: float = 3600.0,
              kill_above_mb: float | None = None, preload: Iterable[str] = ()) -> dict:
    """Run ``setup`` of ``script`` in a fresh process and measure there.

    ``mode="memory"``: one provider; returns :func:`measure_steps`'s dict (``steps`` runs). ``mode="time"``:
    every provider's step built in the same process and timed by :func:`time_alternating`; returns
    ``{provider: Timing}``, each ``extra`` updated with what the step's ``after_timing()`` returns, when it has one
    (run once after the timed rounds, in the same ordinary process). With ``kill_above_mb``, the child is stopped
    once its resident memory exceeds it and ``{"status": "killed above N MB", "process_peak_mb": ...}`` is
    returned (a point that does not fit cannot take the machine down). A child that fails raises RuntimeError with
    the end of its output.

    On the CPU the child is forked from a server that has imported :data:`PRELOAD` and ``preload`` (more modules
    the bench's steps import) and nothing else: no tensor work, no threads started. A child then starts in
    milliseconds instead of importing torch, transformers and peft again (seconds each). The server starts at the
    first call and serves the process's later calls, with the first call's modules. CUDA cannot be used in a
    forked child, so there the child is a new interpreter.
    """
    providers = list(providers)
    if mode not in ("memory", "time"):
        raise ValueError(f"mode must be memory or time, got {mode!r}")
    if mode == "memory" and len(providers) != 1:
        raise ValueError(f"a memory measurement runs one provider per process, got {providers}")
    spec = dict(script=str(Path(script).resolve()), setup=setup, config=config, mode=mode, providers=providers,
                device=device, warmup=warmup, repeats=repeats, steps=steps)
    what = f"{Path(script).name} {mode} {providers} {config}"
    child = _Interpreter(spec) if device.startswith("cuda") else _Forked(spec, [*PRELOAD, *preload])
    start, peak_mb = time.monotonic(), 0.0
    try:
        while child.running():
            if kill_above_mb is not None:
                try:
                    peak_mb = max(peak_mb, _status_kb("VmRSS", str(child.pid)) / 1024)
                except (OSError, RuntimeError):  # the child is exiting
                    pass
                if peak_mb > kill_above_mb:
                    child.kill()
                    return {"status": f"killed above {kill_above_mb:.0f} MB", "process_peak_mb": peak_mb}
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{what}: over {timeout:.0f} s")
            time.sleep(0.05)
    except BaseException:  # the timeout, or Ctrl-C: no child outlives the bench
        child.kill()
        raise
    ok, text = child.result()
    if not ok:
        raise RuntimeError(f"{what} failed:\n{text[-3000:]}")
    result = json.loads(text)
    if mode == "time":
        return {name: Timing(**t) for name, t in result.items()}
    return dict(result, status="ok")


#: What the CPU children's server imports before forking them (see :func:`run_fresh`): the libraries most benches'
#: steps load.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "fastprompt", "fastprompt.model.encoder", "peft")
# glibc's mallopt parameters (malloc.h) that MALLOC_ENV's two variables set
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


class _Interpreter:
    """A child that is a new Python interpreter running this file on the spec (CUDA children)."""

    def __init__(self, spec: dict):
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        env = dict(os.environ, **(MALLOC_ENV if spec["mode"] == "memory" else {}))
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), json.dumps(spec)],
                                      stdout=self._out, stderr=self._err, env=env, text=True)
        self.pid = self._proc.pid

    def running(self) -> bool:
        return self._proc.poll() is None

    def kill(self):
        self._proc.kill()
        self._proc.wait()

    def result(self) -> tuple[bool, str]:
        with self._out, self._err:
            self._out.seek(0)
            self._err.seek(0)
            stdout, stderr = self._out.read(), self._err.read()
        if self._proc.returncode != 0:
            return False, f"exit {self._proc.returncode}:\n{stderr}"
        return True, stdout.strip().splitlines()[-1]


class _Forked:
    """A child forked from multiprocessing's fork server (CPU children; see :func:`run_fresh`)."""

    def __init__(self, spec: dict, preload: list[str]):
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([m for m in preload if importlib.util.find_spec(m.split(".")[0])])
        self._conn, child_conn = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_forked_child, args=(spec, child_conn))
        self._proc.start()
        child_conn.close()
        self.pid, self._message = self._proc.pid, None

    def running(self) -> bool:
        self._receive()
        return self._proc.is_alive()

    def _receive(self):
        # read while the child runs: a message larger than the pipe's buffer would otherwise block its exit
        if self._message is None and self._conn.poll():
            try:
                self._message = self._conn.recv()
            except EOFError:  # it died before sending: result() reports its exit code
                self._message = False

    def kill(self):
        self._proc.kill()
        self._proc.join()

    def result(self) -> tuple[bool, str]:
        self._proc.join()
        self._receive()
        self._conn.close()
        if not self._message:
            return False, f"the child exited with code {self._proc.exitcode} and no result"
        return self._message


def _forked_child(spec: dict, conn) -> None:
    """A forked child's body: the memory mode's glibc settings (what MALLOC_ENV sets in a new interpreter), the
    output kept in a temporary file (its end comes back with a failure), then :func:`_child`."""
    import ctypes
    import traceback

    if spec["mode"] == "memory":
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, int(MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]))
        libc.mallopt(_M_TRIM_THRESHOLD, int(MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]))
        libc.malloc_trim(0)  # what the server's heap holds free goes back now, not at the step's first free
    log = tempfile.TemporaryFile("w+")
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        conn.send((True, json.dumps(_child(spec))))
    except BaseException:
        sys.stderr.flush()
        log.seek(0)
        conn.send((False, log.read()[-6000:] + traceback.format_exc()))
    finally:
        conn.close()


def _child(spec: dict) -> dict:
    path = Path(spec["script"])
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    setup = getattr(module, spec["setup"])
    if spec["mode"] == "memory":
        (provider,) = spec["providers"]
        return measure_steps(setup(provider, **spec["config"]), spec["device"], spec["steps"])
    calls = {p: setup(p, **spec["config"]) for p in spec["providers"]}
    timings = time_alternating(calls, warmup=spec["warmup"], repeats=spec["repeats"],
                               sync=device_sync(spec["device"]))
    for name, call in calls.items():  # untimed, after every timed round: e.g. a profile of one more step
        after = getattr(call, "after_timing", None)
        if after is not None:
            timings[name].extra.update(after())
    return {name: asdict(t) for name, t in timings.items()}


# ------------------------------------------------------------------------------------------------ results
def add_ratios(rows: list[dict], baseline: str, config_keys: Iterable[str]) -> list[dict]:
    """Set ``baseline``, ``time_vs_baseline`` and ``mem_vs_baseline`` of every row against the row of provider
    ``baseline`` with the same configuration (None where that row or its value is missing)."""
    keys = tuple(config_keys)
    base = {tuple(r.get(k) for k in keys): r for r in rows if r.get("provider") == baseline}
    for r in rows:
        ref = base.get(tuple(r.get(k) for k in keys))
        r["baseline"] = baseline
        r["time_vs_baseline"] = _ratio(r.get("median_ms"), ref and ref.get("median_ms"))
        r["mem_vs_baseline"] = _ratio(r.get("peak_mb"), ref and ref.get("peak_mb"))
    return rows


def _ratio(a, b):
    return round(a / b, 3) if a is not None and b else None


def measured(timing: Timing | None = None, memory: dict | None = None, ndigits: int = 3) -> dict:
    """The measured columns of one row: ``median_ms``, ``p20_ms``, ``p80_ms`` and ``repeats`` from ``timing``,
    ``peak_mb`` and ``process_peak_mb`` from a memory result of :func:`run_fresh` (and a ``note`` when its peak
    could not be reset), times rounded to ``ndigits`` decimals, memory to 0.1 MiB."""
    row: dict = {}
    if timing is not None:
        row.update(median_ms=round(timing.median_ms, ndigits), p20_ms=round(timing.p20_ms, ndigits),
                   p80_ms=round(timing.p80_ms, ndigits), repeats=timing.repeats)
    if memory is not None:
        row.update(peak_mb=round(memory["peak_mb"], 1), process_peak_mb=round(memory["process_peak_mb"], 1))
        if not memory.get("exact_peak", True):
            row["note"] = "peak not resettable: the process's high-water mark"
    return row


def results_path(bench: str, device: str) -> Path:
    """The default CSV of a bench: ``bench/results/<bench>_<device>.csv``."""
    return RESULTS / f"{bench}_{device}.csv"


#: The machine fields :func:`write_results` also writes into every CSV row: the CPU model and the vector ISA the
#: run used (torch's kernels, fastprompt's C++ kernels).
CPU_FIELDS = ("cpu", "cpu_capability", "cpu_isa")


def machine(packages: Iterable[str] = ()) -> dict:
    """What the numbers depend on: versions (python, torch, and ``packages``: None where not installed), the
    threads of this process, CPU/GPU model, the vector ISA the run used, and the load when the run started.

    ``cpu_capability`` is the level torch's own CPU kernels dispatch to (``torch.backends.cpu.get_cpu_capability()``:
    DEFAULT, AVX2, AVX512, ...; ``ATEN_CPU_CAPABILITY`` lowers it), ``cpu_isa`` the x86-64 level fastprompt's C++
    kernels run (``FASTPROMPT_CPU_ISA`` lowers it; None without the extension). The bench's child processes
    inherit the environment, so they run the same levels."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": _cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_isa": _cpu_isa(),
            "cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    if packages:
        versions = {"torch": torch.__version__}
        for pkg in packages:
            try:
                versions[pkg] = version(pkg)
            except PackageNotFoundError:
                versions[pkg] = None
        info["versions"] = versions
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def _cpu_isa() -> str | None:
    """The x86-64 level fastprompt's C++ kernels run (``fastprompt.ops.attention_cpu.isa``), None without them."""
    try:
        from fastprompt.ops import _cpp, attention_cpu
    except ImportError:
        return None
    return attention_cpu.isa() if _cpp.available() else None


def command_line() -> str:
    """This process's command as a reader would type it from the repository root: ``python bench/<script> ...``
    (the interpreter's path, and the root part of a script path inside the repository, left out)."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    first = str(script.relative_to(ROOT)) if script and script.is_relative_to(ROOT) else (sys.argv or [""])[0]
    return shlex.join(["python", first, *sys.argv[1:]])


def write_results(rows: list[dict], path: Path, config_keys: Iterable[str], info: dict | None = None,
                  summary: dict | None = None) -> Path:
    """Write ``rows`` as CSV (:data:`LEADING`, ``config_keys``, :data:`MEASURES`, then the other columns in the
    order they first appear, then :data:`CPU_FIELDS` from ``info``) and a JSON sidecar (``path`` with .json)
    holding the command (:func:`command_line`), ``info`` (e.g. :func:`machine`), ``summary`` and the rows. Both
    are replaced atomically; called after every point, so an interrupted run keeps its rows."""
    info = info or {}
    for r in rows:  # every row says which CPU and vector width its numbers come from
        for k in CPU_FIELDS:
            r.setdefault(k, info.get(k))
    fixed = [*LEADING, *config_keys, *MEASURES]
    extra = [k for r in rows for k in r if k not in fixed and k not in CPU_FIELDS]
    columns = fixed + list(dict.fromkeys(extra)) + list(CPU_FIELDS)
    with atomic_file(path, "results") as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)
    sidecar = {"command": command_line(), "machine": info, "summary": summary or {}, "rows": rows}
    write_text_atomic(path.with_suffix(".json"), json.dumps(sidecar, indent=2) + "\n", "results")
    return path


def markdown_table(rows: list[dict], columns: Iterable[str]) -> str:
    """A markdown table of ``columns`` (floats to 4 significant digits, missing values empty)."""
    columns = list(columns)

    def fmt(v):
        return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))


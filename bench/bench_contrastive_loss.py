"""Benchmark: fused contrastive loss (C++ kernel on CPU, Triton on CUDA) vs the plain-PyTorch reference.

Forward + backward of ``contrastive_loss`` for N in 1024..32768 and d in (384, 768), two configurations:
``simcse`` (z1, z2: in-batch InfoNCE) and ``promcse`` (z1, z2, z3 hard negatives + energy-based hinge,
weight 10). For every (config, N, d) both providers are measured in the same run: the median time of
fwd+bwd and the peak *extra* memory (on top of the inputs), then the ratios reference / fused.

Peak memory, CPU: a fresh child process per measurement, with glibc serving every allocation >= 64 KiB by
mmap and returning it on free (MALLOC_MMAP_THRESHOLD_), so RSS follows the live tensors. After a tiny
warm-up (library loading) and the inputs, the kernel's peak-RSS counter is reset (``echo 5 >
/proc/self/clear_refs``), one fwd+bwd runs, and peak extra = VmHWM - VmRSS-before (torch's CPU
allocations are invisible to tracemalloc; RSS is what the machine has to provide; the gradients count).
CUDA: ``torch.cuda.max_memory_allocated`` after a reset. Time: another fresh child runs both providers
alternately (one warm-up step each, then fused, reference, fused, ...) so that load changes on a shared
machine hit both alike, and takes each one's median.

    python bench/bench_contrastive_loss.py                      # CPU, full grid -> bench/results/contrastive_loss_cpu.csv
    python bench/bench_contrastive_loss.py --n 16384 --d 768    # the issue's headline point
    python bench/bench_contrastive_loss.py --device cuda        # Triton vs reference on a GPU

The reference is skipped (recorded as such) where its estimated memory exceeds ``--max-ref-gb``.
"""
from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("bench_contrastive_loss")

CONFIGS = {
    "simcse": dict(z3=False, kw=dict(temperature=0.05)),
    "promcse": dict(z3=True, kw=dict(temperature=0.05, hinge_weight=10.0, hinge_margin=0.2)),
}
FIELDS = ["device", "threads", "config", "n", "d", "fused_provider", "fused_median_s", "reference_median_s",
          "time_ratio_ref_over_fused", "fused_peak_extra_mb", "reference_peak_extra_mb", "mem_ratio_ref_over_fused",
          "repeats", "note"]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def child(mode: str, providers: list[str], config: str, n: int, d: int, device: str, repeats: int) -> dict:
    """One measurement in this (fresh) process. ``memory``: peak extra memory of one fwd+bwd of the single
    provider. ``time``: the providers alternate step by step (fused, reference, fused, ...), so a change of
    load on a shared machine hits both alike; returns each provider's median."""
    import torch

    from fastprompt.ops import contrastive_loss

    cfg = CONFIGS[config]
    backends = {"fused": "auto", "reference": "reference"}

    def inputs(rows):
        g = torch.Generator(device=device).manual_seed(0)
        return [torch.randn(rows, d, generator=g, device=device).requires_grad_() for _ in range(3 if cfg["z3"] else 2)]

    def step(zs, provider):
        for z in zs:
            z.grad = None
        contrastive_loss(*zs, backend=backends[provider], **cfg["kw"]).backward()
        if device == "cuda":
            torch.cuda.synchronize()

    if mode == "memory":
        (provider,) = providers
        step(inputs(16), provider)  # loads the libraries (and the extension) without warming any large buffer
        zs = inputs(n)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(zs, provider)
            return dict(peak_mb=(torch.cuda.max_memory_allocated() - base) / 2**20, exact_peak=True)
        base = _status_kb("VmRSS")
        exact = _reset_peak_rss()
        step(zs, provider)
        return dict(peak_mb=(_status_kb("VmHWM") - base) / 1024, exact_peak=exact)
    zs = inputs(n)
    times = {p: [] for p in providers}
    for p in providers:
        step(zs, p)  # warm-up
    for _ in range(repeats):
        for p in providers:
            t = time.perf_counter()
            step(zs, p)
            times[p].append(time.perf_counter() - t)
    return {p: dict(median_s=statistics.median(ts), times=ts) for p, ts in times.items()}


def run_child(mode, providers, config, n, d, device, repeats, timeout):
    """Runs :func:`child` in a fresh interpreter. For memory, glibc is told to serve every allocation of 64 KiB
    or more with mmap and to give it back on free, so RSS follows the live tensors (otherwise freed heap
    pages stay resident and later allocations reuse them unseen)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, ",".join(providers), config, str(n), str(d),
           device, str(repeats)]
    env = dict(os.environ)
    if mode == "memory":
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {providers} {config} N={n} d={d} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference_gb(config: str, n: int) -> float:
    """Rough peak of the reference: ~5 live (N x M) fp32 matrices at once (cosines, logits, softmax and
    their gradients; the hinge adds a masked copy)."""
    m = n * (2 if CONFIGS[config]["z3"] else 1)
    return (6 if config == "promcse" else 5) * n * m * 4 / 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--d", type=int, nargs="+", default=[384, 768])
    p.add_argument("--config", nargs="+", default=["simcse", "promcse"], choices=sorted(CONFIGS))
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (0: 5; 3 for N >= 16384; 2 for N >= 32768)")
    p.add_argument("--max-ref-gb", type=float, default=10.0, help="skip the reference above this estimate")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/contrastive_loss_<device>.csv)")
    p.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, providers, config, n, d, device, repeats = args.child
        print(json.dumps(child(mode, providers.split(","), config, int(n), int(d), device, int(repeats))))
        return 0

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from fastprompt.ops import _cpp

    if args.device == "cpu" and not _cpp.available():
        raise SystemExit("fastprompt._C is not built: the fused CPU op would fall back to the reference")
    out = args.out or Path(__file__).resolve().parent / "results" / f"contrastive_loss_{args.device}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    rows = []
    from tqdm import tqdm

    grid = [(c, n, d) for c in args.config for d in args.d for n in args.n]
    for config, n, d in tqdm(grid, desc="contrastive_loss bench"):
        repeats = args.repeats or (2 if n >= 32768 else 3 if n >= 16384 else 5)
        with_ref = not (args.device == "cpu" and reference_gb(config, n) > args.max_ref_gb)
        providers = ["fused", "reference"] if with_ref else ["fused"]
        f = run_child("memory", ["fused"], config, n, d, args.device, repeats, args.timeout)
        ref = run_child("memory", ["reference"], config, n, d, args.device, repeats, args.timeout) if with_ref else None
        times = run_child("time", providers, config, n, d, args.device, repeats, args.timeout)
        note = "" if f["exact_peak"] else "peak RSS not resettable: peak is the process high-water mark"
        if not with_ref:
            note = f"reference skipped (estimated {reference_gb(config, n):.0f} GB > --max-ref-gb)"
        row = dict(device=args.device, threads=threads, config=config, n=n, d=d,
                   fused_provider="cpp" if args.device == "cpu" else "triton",
                   fused_median_s=round(times["fused"]["median_s"], 4), fused_peak_extra_mb=round(f["peak_mb"], 1),
                   repeats=repeats, note=note)
        if ref is not None:
            row.update(reference_median_s=round(times["reference"]["median_s"], 4),
                       reference_peak_extra_mb=round(ref["peak_mb"], 1),
                       time_ratio_ref_over_fused=round(times["reference"]["median_s"] / times["fused"]["median_s"], 2),
                       mem_ratio_ref_over_fused=round(ref["peak_mb"] / max(f["peak_mb"], 1e-3), 1))
        rows.append(row)
        logger.info("%s", row)
        with open(out, "w", newline="") as fh:  # rewritten after every point: partial results survive
            w = csv.DictWriter(fh, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    print(f"\n{'config':8s} {'N':>6s} {'d':>4s} {'fused s':>9s} {'ref s':>9s} {'t ref/fused':>11s} "
          f"{'fused MB':>9s} {'ref MB':>9s} {'mem ref/fused':>13s}")
    for r in rows:
        print(f"{r['config']:8s} {r['n']:6d} {r['d']:4d} {r['fused_median_s']:9.3f} "
              f"{r.get('reference_median_s', float('nan')):9.3f} {r.get('time_ratio_ref_over_fused', float('nan')):11.2f} "
              f"{r['fused_peak_extra_mb']:9.1f} {r.get('reference_peak_extra_mb', float('nan')):9.1f} "
              f"{r.get('mem_ratio_ref_over_fused', float('nan')):13.1f}")
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the fused contrastive loss (C++ kernel on CPU, Triton on CUDA) vs the plain-PyTorch reference.

Forward + backward of ``contrastive_loss`` for N in 1024..32768 and d in (384, 768), two losses: ``simcse``
(z1, z2: in-batch InfoNCE) and ``promcse`` (z1, z2, z3 hard negatives + energy-based hinge, weight 10).
Every point measures both providers with bench/_harness.py: the time of fwd+bwd (both alternating in one
fresh process; median and 20th/80th percentiles) and the peak memory of one fwd+bwd above the inputs (a
fresh process per provider; the gradients count). Ratios are fused / reference (below 1: the fused op wins).

    python bench/bench_contrastive_loss.py                      # CPU, full grid -> results/contrastive_loss_cpu.csv
    python bench/bench_contrastive_loss.py --n 16384 --d 768    # one point
    python bench/bench_contrastive_loss.py --device cuda        # Triton vs reference on a GPU

The reference is skipped (recorded as such) where its estimated memory exceeds ``--max-ref-gb``.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
from _harness import add_ratios, machine, markdown_table, results_path, run_fresh, write_results
from tqdm import tqdm

from fastprompt.ops import _cpp, contrastive_loss

logger = logging.getLogger("bench_contrastive_loss")

LOSSES = {
    "simcse": dict(z3=False, kw=dict(temperature=0.05)),
    "promcse": dict(z3=True, kw=dict(temperature=0.05, hinge_weight=10.0, hinge_margin=0.2)),
}
PROVIDERS = {"fused": "auto", "reference": "reference"}  # provider -> backend of contrastive_loss
CONFIG_KEYS = ("loss", "n", "d")


def setup(provider: str, loss: str, n: int, d: int, device: str):
    """Inputs of one point and the step that runs one fwd+bwd of ``provider`` (after a tiny warm-up step that
    loads the libraries without warming any large buffer)."""
    cfg = LOSSES[loss]

    def inputs(rows):
        g = torch.Generator(device=device).manual_seed(0)
        count = 3 if cfg["z3"] else 2
        return [torch.randn(rows, d, generator=g, device=device).requires_grad_() for _ in range(count)]

    def run(zs):
        for z in zs:
            z.grad = None
        contrastive_loss(*zs, backend=PROVIDERS[provider], **cfg["kw"]).backward()

    run(inputs(16))
    zs = inputs(n)
    return lambda: run(zs)


def reference_gb(loss: str, n: int) -> float:
    """Rough peak of the reference: ~5 live (N x M) fp32 matrices at once (cosines, logits, softmax and
    their gradients; the hinge adds a masked copy)."""
    m = n * (2 if LOSSES[loss]["z3"] else 1)
    return (6 if loss == "promcse" else 5) * n * m * 4 / 2**30


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--d", type=int, nargs="+", default=[384, 768])
    p.add_argument("--loss", nargs="+", default=sorted(LOSSES), choices=sorted(LOSSES))
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (0: 5; 3 for N >= 16384; 2 for N >= 32768)")
    p.add_argument("--max-ref-gb", type=float, default=10.0, help="skip the reference above this estimate")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV path (default bench/results/contrastive_loss_<device>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cpu" and not _cpp.available():
        raise SystemExit("fastprompt._C is not built: the fused CPU op would fall back to the reference")
    out = args.out or results_path("contrastive_loss", args.device)
    info = machine()
    rows = []
    grid = [(loss, n, d) for loss in args.loss for d in args.d for n in args.n]
    for loss, n, d in tqdm(grid, desc="contrastive_loss bench"):
        repeats = args.repeats or (2 if n >= 32768 else 3 if n >= 16384 else 5)
        config = dict(loss=loss, n=n, d=d, device=args.device)
        with_ref = not (args.device == "cpu" and reference_gb(loss, n) > args.max_ref_gb)
        providers = list(PROVIDERS) if with_ref else ["fused"]
        times = run_fresh(__file__, "setup", config, mode="time", providers=providers, device=args.device,
                          warmup=1, repeats=repeats, timeout=args.timeout)
        for provider in providers:
            mem = run_fresh(__file__, "setup", config, mode="memory", providers=[provider], device=args.device,
                            timeout=args.timeout)
            t = times[provider]
            note = "" if mem["exact_peak"] else "peak not resettable: the process's high-water mark"
            rows.append(dict(bench="contrastive_loss", device=args.device, provider=provider, loss=loss, n=n, d=d,
                             median_ms=round(t.median_ms, 3), p20_ms=round(t.p20_ms, 3), p80_ms=round(t.p80_ms, 3),
                             peak_mb=round(mem["peak_mb"], 1), repeats=t.repeats,
                             backend=("cpp" if args.device == "cpu" else "triton") if provider == "fused"
                             else "reference", note=note))
        if not with_ref:
            rows.append(dict(bench="contrastive_loss", device=args.device, provider="reference", loss=loss, n=n,
                             d=d, note=f"skipped (estimated {reference_gb(loss, n):.0f} GB > --max-ref-gb)"))
        add_ratios(rows, "reference", CONFIG_KEYS)
        logger.info("%s", rows[-len(PROVIDERS):])
        write_results(rows, out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["loss", "n", "d", "provider", "median_ms", "peak_mb", "time_vs_baseline",
                                "mem_vs_baseline"]))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

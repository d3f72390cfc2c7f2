"""Benchmark: the fused contrastive loss against its baselines, forward + backward.

Providers (each runs one fwd+bwd of the same loss on the same inputs):

- ``fused``: the C++ kernel (CPU only);
- ``triton``: the fused Triton kernels (``backend="triton"``: statistics on tensor cores with the columns split
  across programs, the gradient in the forward from stored row chunks of the similarity matrix). On the CPU only
  under the Triton interpreter (``TRITON_INTERPRET=1``, as the test suite sets it): a smoke check, not a timing;
- ``chunked``: cuBLAS products with one Triton epilogue per row chunk (``backend="chunked"``; on the CPU as above);
- ``torch_chunked``: a plain-PyTorch chunked-matmul loss (a custom autograd.Function: row chunks of the logits from
  ``torch.mm``, their log-sum-exp in the forward, recomputed in the backward; the InfoNCE and the hinge only);
- ``reference``: eager PyTorch on the full N x M matrix (``backend="reference"``), skipped where its estimated memory
  exceeds ``--max-ref-gb``.

Two losses: ``simcse`` (z1, z2: in-batch InfoNCE) and ``promcse`` (z1, z2, z3 hard negatives + the energy-based hinge,
weight 10; M = 2N columns); with ``--options``, ``simcse`` and each of the loss's options alone on top of it
(:data:`OPTIONS`: symmetric, hardness weighting, the false-negative mask by text ids, GISTEmbed's margin mask by the
model's own and by a guide's cosines, Matryoshka at four dimensions). Every point measures its providers with
bench/_harness.py: the time of fwd+bwd (all providers alternating in one fresh process; median and 20th/80th
percentiles) and the peak memory of one fwd+bwd above the inputs (a fresh process per provider; the gradients count).
``tflops`` is the useful work over the median time: 3 products of 2·N·M·d (S = X·Cᵀ, dS·C, dSᵀ·X), whatever a provider
does to get there (the streaming or recomputing paths do 4-5); ``peak_fraction`` that over the GPU's dense peak for
the dtype (bf16/fp16; ``tf32``: fp32 inputs with TF32 allowed; ``fp32``: exact, the FMA peak; empty on the CPU).
Ratios are provider / reference.

    python bench/bench_contrastive_loss.py                       # CPU grid -> results/contrastive_loss_cpu.csv
    python bench/bench_contrastive_loss.py --smoke               # tiny sizes (the test suite's run)
    python bench/bench_contrastive_loss.py --device cuda         # bf16 and tf32, N = 4k/16k/65k, d = 768/1024
    python bench/bench_contrastive_loss.py --device cuda --n 65536 --d 768 --dtype bf16 --loss simcse
    python bench/bench_contrastive_loss.py --options --n 16384 --d 768 --providers fused reference  # per option
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import add_ratios, machine, markdown_table, results_path, run_fresh, write_results
from tqdm import tqdm

from fastprompt.ops import Guide, _cpp, contrastive_loss

logger = logging.getLogger("bench_contrastive_loss")

LOSSES = {
    "simcse": dict(z3=False, kw=dict(temperature=0.05)),
    "promcse": dict(z3=True, kw=dict(temperature=0.05, hinge_weight=10.0, hinge_margin=0.2)),
}
#: The loss's options, each alone on top of ``simcse`` (``--loss`` takes their names too; not in the default
#: grid): what each costs in time and memory against the reference with the same option. ``extra(n, d, device)``
#: builds the option's tensor arguments (text ids with repeats, a guide model's embeddings).
OPTIONS = {
    "simcse+symmetric": dict(kw=dict(symmetric=True)),
    "simcse+hardness": dict(kw=dict(hardness_mode="in_batch_negatives", hardness_strength=5.0)),
    "simcse+fn_ids": dict(kw=dict(), extra=lambda n, d, device: dict(  # every 8th text repeats another row's
        column_ids=torch.arange(n, device=device).masked_fill(torch.arange(n, device=device) % 8 == 7, 0))),
    "simcse+fn_margin": dict(kw=dict(fn_margin=0.1)),
    "simcse+guide": dict(kw=dict(fn_margin=0.1), extra=lambda n, d, device: dict(guide=Guide(
        *(torch.randn(n, 384, generator=torch.Generator(device=device).manual_seed(s), device=device)
          for s in (1, 2))))),
    "simcse+matryoshka": dict(kw=dict(), extra=lambda n, d, device: dict(
        matryoshka_dims=[d // 8, d // 4, d // 2, d])),
}
for _name, _opt in OPTIONS.items():
    LOSSES[_name] = dict(z3=False, kw=dict(LOSSES["simcse"]["kw"], **_opt["kw"]), extra=_opt.get("extra"))
#: provider -> backend of contrastive_loss (None: the plain-PyTorch chunked loss of this file)
PROVIDERS = {"fused": "cpu", "triton": "triton", "chunked": "chunked", "torch_chunked": None,
             "reference": "reference"}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIG_KEYS = ("loss", "dtype", "n", "d")
#: rows per chunk of the torch_chunked provider
TORCH_CHUNK = 4096
SMOKE = dict(n=[16], d=[16], loss=["simcse"], dtype=["fp32"], repeats=2)


class _ChunkedInfoNCE(torch.autograd.Function):
    """The plain-PyTorch chunked-matmul loss: unit anchors u (n, d) against unit columns v (M, d), the positive of
    row i at column i; per row chunk the logits u_c·vᵀ/τ (torch.mm in the input dtype, fp32 after), their
    log-sum-exp and, with a hinge weight, PromCSE's hinge on the hardest negative; the backward recomputes each
    chunk's logits. Returns the mean row loss."""

    @staticmethod
    def forward(ctx, u, v, tau, hinge_weight, margin, chunk):
        n = u.shape[0]
        rows = torch.empty(n, device=u.device, dtype=torch.float32)
        lse = torch.empty_like(rows)
        hard_idx = torch.zeros(n, device=u.device, dtype=torch.int64)
        active = torch.zeros(n, device=u.device, dtype=torch.bool)
        for r0 in range(0, n, chunk):
            cos = torch.mm(u[r0:r0 + chunk], v.t()).float()
            idx = torch.arange(r0, r0 + cos.shape[0], device=u.device)
            local = torch.arange(cos.shape[0], device=u.device)
            pos = cos[local, idx]
            lse[r0:r0 + chunk] = torch.logsumexp(cos / tau, 1)
            rows[r0:r0 + chunk] = lse[r0:r0 + chunk] - pos / tau
            if hinge_weight:
                hard, hidx = cos.index_put((local, idx), torch.tensor(float("-inf"), device=u.device)).max(1)
                hinge = margin + hard - pos
                rows[r0:r0 + chunk] += hinge_weight * hinge.clamp_min(0)
                hard_idx[r0:r0 + chunk], active[r0:r0 + chunk] = hidx, hinge > 0
        ctx.save_for_backward(u, v, lse, hard_idx, active)
        ctx.args = (tau, hinge_weight, chunk)
        return rows.mean()

    @staticmethod
    def backward(ctx, grad):
        u, v, lse, hard_idx, active = ctx.saved_tensors
        tau, hinge_weight, chunk = ctx.args
        n = u.shape[0]
        g = grad.float() / n
        du, dv = torch.empty_like(u), torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        for r0 in range(0, n, chunk):
            cos = torch.mm(u[r0:r0 + chunk], v.t()).float()
            idx = torch.arange(r0, r0 + cos.shape[0], device=u.device)
            local = torch.arange(cos.shape[0], device=u.device)
            ds = torch.exp(cos / tau - lse[r0:r0 + chunk, None]) * (g / tau)
            ds[local, idx] -= g / tau
            if hinge_weight:
                w = g * hinge_weight * active[r0:r0 + chunk].float()
                ds[local, hard_idx[r0:r0 + chunk]] += w
                ds[local, idx] -= w
            ds = ds.to(u.dtype)
            du[r0:r0 + chunk] = torch.mm(ds, v)
            dv += torch.mm(ds.t(), u[r0:r0 + chunk]).float()
        return du, dv.to(v.dtype), None, None, None, None


def torch_chunked_loss(z1, z2, z3=None, temperature=0.05, hinge_weight=0.0, hinge_margin=0.2):
    cols = z2 if z3 is None else torch.cat([z2, z3])
    u, v = F.normalize(z1, dim=-1), F.normalize(cols, dim=-1)
    return _ChunkedInfoNCE.apply(u, v, temperature, hinge_weight, hinge_margin, TORCH_CHUNK)


def setup(provider: str, loss: str, dtype: str, n: int, d: int, device: str):
    """Inputs of one point and the step that runs one fwd+bwd of ``provider`` (after a tiny warm-up step that
    loads the libraries and compiles the kernels without warming any large buffer)."""
    cfg = LOSSES[loss]
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"

    def inputs(rows):
        g = torch.Generator(device=device).manual_seed(0)
        count = 3 if cfg["z3"] else 2
        return [torch.randn(rows, d, generator=g, device=device).to(DTYPES[dtype]).requires_grad_()
                for _ in range(count)]

    def extra(rows):
        return cfg["extra"](rows, d, device) if cfg.get("extra") else {}

    def run(zs, kw):
        for z in zs:
            z.grad = None
        if provider == "torch_chunked":
            if kw or cfg["kw"].keys() - {"temperature", "hinge_weight", "hinge_margin"}:
                raise ValueError(f"torch_chunked has the InfoNCE and the hinge only, not {loss}'s option")
            torch_chunked_loss(*zs, **cfg["kw"]).backward()
        else:
            contrastive_loss(*zs, backend=PROVIDERS[provider], **cfg["kw"], **kw).backward()

    run(inputs(16), extra(16))
    zs, kw = inputs(n), extra(n)
    return lambda: run(zs, kw)


def reference_gb(loss: str, n: int) -> float:
    """Rough peak of the reference: ~5 live (N x M) fp32 matrices at once (cosines, logits, softmax and
    their gradients; the hinge adds a masked copy)."""
    m = n * (2 if LOSSES[loss]["z3"] else 1)
    return (5 if loss == "simcse" else 6) * n * m * 4 / 2**30  # an option's mask or weights: one more


def useful_flops(loss: str, n: int, d: int) -> int:
    """3 products of 2·N·M·d: S = X·Cᵀ, dS·C and dSᵀ·X."""
    m = n * (2 if LOSSES[loss]["z3"] else 1)
    return 3 * 2 * n * m * d


def peak_tflops(device: str, dtype: str) -> float | None:
    """The GPU's dense peak for the dtype tag (bench_prefix_attention's table), None on the CPU or an unknown GPU."""
    if device != "cuda":
        return None
    from bench_prefix_attention import PEAK_TFLOPS

    name = torch.cuda.get_device_name()
    return next((peaks.get(dtype) for model, peaks in PEAK_TFLOPS.items() if model in name), None)


def available_providers(device: str) -> list[str]:
    """Every provider that runs on ``device``: on the CPU the C++ kernel, and the Triton ones only under the
    interpreter; on CUDA the Triton ones."""
    if device == "cuda":
        return ["triton", "chunked", "torch_chunked", "reference"]
    triton = ["triton", "chunked"] if os.environ.get("TRITON_INTERPRET") == "1" else []
    return ["fused", *triton, "torch_chunked", "reference"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--n", type=int, nargs="+", default=None,
                   help="rows (default: CPU 1024..32768; CUDA 4096 16384 65536)")
    p.add_argument("--d", type=int, nargs="+", default=None, help="width (default: CPU 384 768; CUDA 768 1024)")
    p.add_argument("--loss", nargs="+", default=None, choices=list(LOSSES),
                   help="default: simcse and promcse; simcse+<option>: one of the loss's options (--options: all)")
    p.add_argument("--options", action="store_true", help="the loss's options, each on top of simcse, and simcse")
    p.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                   help="input dtypes; tf32: fp32 inputs with TF32 allowed (default: CPU fp32; CUDA bf16 tf32)")
    p.add_argument("--providers", nargs="+", default=None, choices=sorted(PROVIDERS),
                   help="default: every provider that runs on the device")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats (the test suite's CPU run)")
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (0: 5; 3 for N >= 16384; 2 for N >= 32768)")
    p.add_argument("--max-ref-gb", type=float, default=10.0, help="skip the reference above this estimate")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None,
                   help="CSV path (default bench/results/contrastive_loss_<device>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = args.device == "cuda"
    if args.smoke:  # the smoke sizes, where the command line does not say otherwise
        for name, value in SMOKE.items():
            if not getattr(args, name):
                setattr(args, name, value)
    args.loss = args.loss or (["simcse", *OPTIONS] if args.options else ["promcse", "simcse"])
    args.n = args.n or ([4096, 16384, 65536] if cuda else [1024, 2048, 4096, 8192, 16384, 32768])
    args.d = args.d or ([768, 1024] if cuda else [384, 768])
    args.dtype = args.dtype or (["bf16", "tf32"] if cuda else ["fp32"])
    providers = args.providers or available_providers(args.device)
    # the CPU children fork from a server that has imported the Triton kernels already (the interpreter's smoke)
    preload = ["fastprompt.kernels.contrastive_chunked"] if {"triton", "chunked"} & set(providers) else []
    if "fused" in providers and not _cpp.available():
        raise SystemExit("fastprompt._C is not built: the fused CPU op would fall back to the reference")
    out = args.out or results_path("contrastive_loss", args.device)
    info = machine()
    rows = []
    grid = [(loss, dt, n, d) for loss in args.loss for dt in args.dtype for d in args.d for n in args.n]
    for loss, dt, n, d in tqdm(grid, desc="contrastive_loss bench"):
        repeats = args.repeats or (2 if n >= 32768 else 3 if n >= 16384 else 5)
        config = dict(loss=loss, dtype=dt, n=n, d=d, device=args.device)
        ref_skipped = "reference" in providers and reference_gb(loss, n) > args.max_ref_gb
        run = [pr for pr in providers if not (pr == "reference" and ref_skipped)]
        times = run_fresh(__file__, "setup", config, mode="time", providers=run, device=args.device,
                          warmup=1, repeats=repeats, timeout=args.timeout, preload=preload)
        peak = peak_tflops(args.device, dt)
        for provider in run:
            mem = run_fresh(__file__, "setup", config, mode="memory", providers=[provider], device=args.device,
                            timeout=args.timeout, preload=preload)
            t = times[provider]
            tflops = useful_flops(loss, n, d) / (t.median_ms * 1e-3) / 1e12
            note = "" if mem["exact_peak"] else "peak not resettable: the process's high-water mark"
            rows.append(dict(bench="contrastive_loss", device=args.device, provider=provider, loss=loss, dtype=dt,
                             n=n, d=d, median_ms=round(t.median_ms, 3), p20_ms=round(t.p20_ms, 3),
                             p80_ms=round(t.p80_ms, 3), peak_mb=round(mem["peak_mb"], 1), repeats=t.repeats,
                             backend=PROVIDERS[provider] or "torch", tflops=float(f"{tflops:.4g}"),
                             peak_fraction="" if peak is None else float(f"{tflops / peak:.4g}"), note=note))
        if ref_skipped:
            rows.append(dict(bench="contrastive_loss", device=args.device, provider="reference", loss=loss,
                             dtype=dt, n=n, d=d, note=f"skipped (estimated {reference_gb(loss, n):.0f} GB > "
                                                      "--max-ref-gb)"))
        add_ratios(rows, "reference", CONFIG_KEYS)
        logger.info("%s", rows[-len(providers):])
        write_results(rows, out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["loss", "dtype", "n", "d", "provider", "median_ms", "peak_mb", "tflops",
                                "peak_fraction", "time_vs_baseline", "mem_vs_baseline"]))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Prefix attention: fastprompt's fused op vs SDPA on the concatenated K/V vs eager attention on the
concatenation (what prefix-tuning code does today), forward and forward+backward.

BERT-base attention shapes by default (B = 64..512, S = 32, P = 16, H = 12, D = 64), q/k/v as transformers
makes them (``view(B, S, H, D).transpose(1, 2)``), a padding mask with lengths uniform in [S/2, S] and a
(H, P, D) trainable prefix. On CUDA the op runs its Triton kernels; on CPU it runs the op's CPU path
(``backend="auto"``), against the same references. "fwd" is inference (no_grad); "fwd+bwd" runs the forward
with gradients (and ``--dropout`` on the probabilities) and the backward of ``(out * grad).sum()`` into q,
k, v and the prefix.

Per point: median (and 20th/80th percentile) wall time over ``--repeats`` after ``--warmup`` calls, and peak
memory allocated by one call above what was live before it (CUDA: the caching allocator's peak; CPU: the
torch profiler's allocation timeline). Ratios are against ``sdpa_concat`` measured in the same run. Results
go to CSV (and a table on stdout).

    python bench/bench_prefix_attention.py                          # CPU: fp32, B = 64,128,256,512
    python bench/bench_prefix_attention.py --batches 64,512 --repeats 5 --out /tmp/pa.csv
    python bench/bench_prefix_attention.py --modes fwd+bwd --dropout 0.1 --out bench/results/pa_cpu_dropout.csv
    python bench/bench_prefix_attention.py --device cuda --dtype bf16
"""
from __future__ import annotations

import argparse
import csv
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastprompt.ops import prefix_attention

ROOT = Path(__file__).resolve().parents[1]
PROVIDERS = ("fastprompt", "sdpa_concat", "eager_concat")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
logger = logging.getLogger("bench_prefix_attention")


def make_inputs(B, S, P, H, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(device, dtype).transpose(1, 2) for _ in range(3))
    pk, pv = (torch.randn(H, P, D, generator=g).to(device, dtype) for _ in range(2))
    lengths = torch.randint(S // 2, S + 1, (B,), generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).to(device)
    return q, k, v, pk, pv, mask


def concat_kv(k, v, pk, pv, mask):
    """What prefix-tuning implementations do per layer: expand the prefix over the batch and concatenate."""
    B, P = k.shape[0], pk.shape[1]
    keys = torch.cat([pk.unsqueeze(0).expand(B, -1, -1, -1), k], 2)
    values = torch.cat([pv.unsqueeze(0).expand(B, -1, -1, -1), v], 2)
    visible = torch.cat([mask.new_ones(B, P), mask], 1)[:, None, None, :]
    return keys, values, visible


def run_provider(name, q, k, v, pk, pv, mask, scale, backend, dropout_p=0.0):
    if name == "fastprompt":
        return prefix_attention(q, k, v, pk, pv, mask, scale=scale, dropout_p=dropout_p, seed=0 if dropout_p else None,
                                backend=backend)
    keys, values, visible = concat_kv(k, v, pk, pv, mask)
    if name == "sdpa_concat":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, dropout_p=dropout_p)
    scores = (q @ keys.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return F.dropout(probs, dropout_p) @ values


def make_call(name, mode, inputs, scale, backend, dropout_p=0.0):
    q, k, v, pk, pv, mask = inputs
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return run_provider(name, q, k, v, pk, pv, mask, scale, backend)
        return call
    leaves = [x.detach().requires_grad_() for x in (q, k, v, pk, pv)]
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)

    def call():
        out = run_provider(name, *leaves[:3], *leaves[3:], mask, scale, backend, dropout_p)
        return torch.autograd.grad(out, leaves, grad)
    return call


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(call, device, warmup, repeats):
    for _ in range(warmup):
        call()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q20, q80 = times[int(0.2 * (len(times) - 1))], times[int(0.8 * (len(times) - 1))]
    return statistics.median(times), q20, q80


def peak_memory_bytes(call, device) -> int:
    """Peak bytes allocated during one call above what was live before it."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = call()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del result
        return peak
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    del result
    # The profiler gives each op's net self allocation (its allocations minus the frees it did itself, e.g. of
    # temporaries); count net allocations at the op's start and net frees at its end ("[memory]" events are
    # frees outside any op). Good to the granularity of one op.
    deltas = sorted((e.time_range.start if e.self_cpu_memory_usage > 0 else e.time_range.end, e.self_cpu_memory_usage)
                    for e in prof.events() if e.self_cpu_memory_usage)
    cur = peak = 0
    for _, d in deltas:
        cur += d
        peak = max(peak, cur)
    return peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,128,256,512", help="comma-separated batch sizes")
    p.add_argument("--seq", type=int, default=32, help="S, tokens per sentence")
    p.add_argument("--prefix", type=int, default=16, help="P, prefix length")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--backend", default="auto", help="backend of the fastprompt op")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout in fwd+bwd (training)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="timed calls per point (default: 10 CPU, 50 CUDA)")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/prefix_attention_<dev>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    repeats = args.repeats or (50 if device.type == "cuda" else 10)
    providers = [x for x in args.providers.split(",") if x]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    out_path = args.out or ROOT / "bench" / "results" / f"prefix_attention_{device.type}.csv"
    S, P, H, D = args.seq, args.prefix, args.heads, args.head_dim
    scale = D ** -0.5
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        inputs = make_inputs(B, S, P, H, D, dtype, device)
        with torch.no_grad():
            want = run_provider("sdpa_concat", *inputs, scale, args.backend).float()
        for mode in args.modes.split(","):
            point = {}
            for name in providers:
                call = make_call(name, mode, inputs, scale, args.backend, args.dropout)
                med, q20, q80 = time_call(call, device, args.warmup, repeats)
                peak = peak_memory_bytes(call, device)
                with torch.no_grad():
                    err = (run_provider(name, *inputs, scale, args.backend).float() - want).abs().max().item()
                point[name] = dict(device=device.type, dtype=str(dtype).replace("torch.", ""), provider=name,
                                   mode=mode, dropout=args.dropout if mode != "fwd" else 0.0,
                                   B=B, S=S, P=P, H=H, D=D, threads=torch.get_num_threads(),
                                   median_ms=round(med, 4), p20_ms=round(q20, 4), p80_ms=round(q80, 4),
                                   peak_mem_mb=round(peak / 2**20, 3), max_abs_err_vs_sdpa=err)
                logger.info("B=%d %-8s %-13s %9.3f ms  %9.2f MiB", B, mode, name, med, peak / 2**20)
            ref = point.get("sdpa_concat")
            for r in point.values():
                r["time_vs_sdpa"] = round(r["median_ms"] / ref["median_ms"], 3) if ref else None
                has_mem = ref and ref["peak_mem_mb"]
                r["mem_vs_sdpa"] = round(r["peak_mem_mb"] / ref["peak_mem_mb"], 3) if has_mem else None
                rows.append(r)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\n| B | mode | provider | median ms | peak MiB | time vs SDPA | memory vs SDPA |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['mode']} | {r['provider']} | {r['median_ms']:.2f} | {r['peak_mem_mb']:.1f} | "
              f"{r['time_vs_sdpa']} | {r['mem_vs_sdpa']} |")
    print(f"\n{device.type}, {dtype}, S={S} P={P} H={H} D={D}, dropout in fwd+bwd {args.dropout}, "
          f"{torch.get_num_threads()} threads; wrote {out_path}")


if __name__ == "__main__":
    main()

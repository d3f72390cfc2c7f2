"""Prefix attention: fastprompt's fused op vs SDPA on the concatenated K/V vs eager attention on the
concatenation (what prefix-tuning code does today), forward and forward+backward.

BERT-base attention shapes by default (B = 64..512, S = 32, P = 16, H = 12, D = 64), q/k/v as transformers
makes them (``view(B, S, H, D).transpose(1, 2)``), a padding mask with lengths uniform in [S/2, S] and a
(H, P, D) trainable prefix. On CUDA the op runs its Triton kernels; on CPU it runs the op's CPU path
(``backend="auto"``), against the same references. "fwd" is inference (no_grad); "fwd+bwd" runs the forward
with gradients (and ``--dropout`` on the probabilities) and the backward of ``(out * grad).sum()`` into q,
k, v and the prefix.

Per point, with bench/_harness.py: the providers' times alternating in one fresh process (median, 20th and
80th percentiles over ``--repeats`` after ``--warmup`` rounds), and the peak memory of one call above what
was live before it, a fresh process per provider. Ratios are against ``sdpa_concat`` measured in the same
run; ``max_abs_err_vs_sdpa`` checks that every provider computes the same attention.

    python bench/bench_prefix_attention.py                          # CPU: fp32, B = 64,128,256,512
    python bench/bench_prefix_attention.py --batches 64,512 --repeats 5 --out /tmp/pa.csv
    python bench/bench_prefix_attention.py --modes fwd+bwd --dropout 0.1 --out bench/results/pa_cpu_dropout.csv
    python bench/bench_prefix_attention.py --device cuda --dtype bf16
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import add_ratios, machine, markdown_table, results_path, run_fresh, write_results

from fastprompt.ops import prefix_attention

PROVIDERS = ("fastprompt", "sdpa_concat", "eager_concat")
DTYPES = ("fp32", "fp16", "bf16")
CONFIG_KEYS = ("dtype", "mode", "dropout", "B", "S", "P", "H", "D")
logger = logging.getLogger("bench_prefix_attention")


def make_inputs(B, S, P, H, D, dtype, device, seed=0):
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(device, dt).transpose(1, 2) for _ in range(3))
    pk, pv = (torch.randn(H, P, D, generator=g).to(device, dt) for _ in range(2))
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


def setup(provider, mode, B, S, P, H, D, dtype, device, backend="auto", dropout=0.0):
    """The inputs of one point and the step that runs ``provider`` once in ``mode`` (after one small call that
    loads the libraries)."""
    def make(batch):
        q, k, v, pk, pv, mask = make_inputs(batch, S, P, H, D, dtype, device)
        scale = D ** -0.5
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    run_provider(provider, q, k, v, pk, pv, mask, scale, backend)
            return call
        leaves = [x.detach().requires_grad_() for x in (q, k, v, pk, pv)]
        grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)

        def call():
            out = run_provider(provider, *leaves, mask, scale, backend, dropout)
            torch.autograd.grad(out, leaves, grad)
        return call

    make(2)()
    return make(B)


def max_abs_err(provider, B, S, P, H, D, dtype, device, backend) -> float:
    """Largest difference between ``provider``'s forward and SDPA on the concatenation (no dropout)."""
    inputs = make_inputs(B, S, P, H, D, dtype, device)
    with torch.no_grad():
        want = run_provider("sdpa_concat", *inputs, D ** -0.5, backend).float()
        return (run_provider(provider, *inputs, D ** -0.5, backend).float() - want).abs().max().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,128,256,512", help="comma-separated batch sizes")
    p.add_argument("--seq", type=int, default=32, help="S, tokens per sentence")
    p.add_argument("--prefix", type=int, default=16, help="P, prefix length")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--backend", default="auto", help="backend of the fastprompt op")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout in fwd+bwd (training)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per point (default: 10 CPU, 50 CUDA)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/prefix_attention_<dev>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    repeats = args.repeats or (50 if args.device == "cuda" else 10)
    providers = [x for x in args.providers.split(",") if x]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {PROVIDERS}")
    out = args.out or results_path("prefix_attention", args.device)
    S, P, H, D = args.seq, args.prefix, args.heads, args.head_dim
    info = machine()
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            dropout = args.dropout if mode != "fwd" else 0.0
            config = dict(mode=mode, B=B, S=S, P=P, H=H, D=D, dtype=dtype, device=args.device, backend=args.backend,
                          dropout=dropout)
            times = run_fresh(__file__, "setup", config, mode="time", providers=providers, device=args.device,
                              warmup=args.warmup, repeats=repeats, timeout=args.timeout)
            for name in providers:
                mem = run_fresh(__file__, "setup", config, mode="memory", providers=[name], device=args.device,
                                timeout=args.timeout)
                t = times[name]
                rows.append(dict(bench="prefix_attention", device=args.device, provider=name, dtype=dtype, mode=mode,
                                 dropout=dropout, B=B, S=S, P=P, H=H, D=D, median_ms=round(t.median_ms, 4),
                                 p20_ms=round(t.p20_ms, 4), p80_ms=round(t.p80_ms, 4), peak_mb=round(mem["peak_mb"], 3),
                                 repeats=t.repeats, max_abs_err_vs_sdpa=max_abs_err(name, B, S, P, H, D, dtype,
                                                                                    args.device, args.backend)))
                logger.info("B=%d %-8s %-13s %9.3f ms  %9.2f MiB", B, mode, name, t.median_ms, mem["peak_mb"])
            add_ratios(rows, "sdpa_concat", CONFIG_KEYS)
            write_results(rows, out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["B", "mode", "provider", "median_ms", "peak_mb", "time_vs_baseline",
                                "mem_vs_baseline"]))
    print(f"\n{args.device}, {dtype}, S={S} P={P} H={H} D={D}, dropout in fwd+bwd {args.dropout}, "
          f"{info['threads']} threads; wrote {out}")


if __name__ == "__main__":
    sys.exit(main())

"""Prefix attention: fastprompt's fused op vs SDPA on the concatenated K/V vs eager attention on the
concatenation (what prefix-tuning code does today), forward and forward+backward.

BERT-base attention shapes by default (H = 12, D = 64, P = 16): on the CPU B = 64..512 at S = 32, on CUDA the sizes
GPU users train at, (B, S) = (512, 128), (1024, 32), (64, 32) in bf16 (``--shapes``); q/k/v as transformers makes
them (``view(B, S, H, D).transpose(1, 2)``), a padding mask with lengths uniform in [S/2, S] and a (Hkv, P, D)
trainable prefix. On CUDA the op runs its Triton kernels; on CPU it runs the op's CPU path (``backend="auto"``),
against the same references. ``sdpa_concat`` is also PEFT's prefix-tuning path at the op level (its cache holds
the prefix as past keys: expanded over the batch, concatenated, SDPA); on CUDA ``sdpa_efficient`` and
``sdpa_cudnn`` pin SDPA's memory-efficient and cuDNN backends on the same concatenation (with its padding mask),
and ``sdpa_flash`` FlashAttention's, which takes no mask: it attends to every padded key too (the time of an
unmasked attention of the same size, a floor; its ``max_abs_err_vs_sdpa`` is left empty). "fwd" is inference
(no_grad); "fwd+bwd" runs the forward with gradients (and ``--dropout`` on the probabilities) and the backward of
``(out * grad).sum()`` into q, k, v and the prefix. ``fastprompt_packed`` runs the same batch packed: only its
real tokens, back to back, with ``cu_seqlens`` (issue #29: the work a padded batch spends on padding rows is not
done). ``--kv-heads`` makes
k, v grouped-query (the references broadcast them with SDPA's ``enable_gqa`` / transformers' ``repeat_kv``),
``--causal`` a decoder's causal token block (the prefix visible to every row).

Per point, with bench/_harness.py: the providers' times alternating in one fresh process (median, 20th and
80th percentiles over ``--repeats`` after ``--warmup`` rounds), and the peak memory of one call above what
was live before it, a fresh process per provider. Ratios are against ``sdpa_concat`` measured in the same
run; ``max_abs_err_vs_sdpa`` checks that every provider computes the same attention. ``tflops`` is the useful
matrix work over the real tokens (4 B H S_real (P + S_real) D per forward, 3x that forward + backward: QK^T and
PV, then dP, dV, dQ, dK; as fastprompt/train/flops.py counts attention) per second of the median time, and
``peak_fraction`` that over the GPU's dense tensor-core peak for the dtype (:data:`PEAK_TFLOPS`; empty on the CPU
or an unlisted GPU).

    python bench/bench_prefix_attention.py                          # CPU: fp32, B = 64,128,256,512
    python bench/bench_prefix_attention.py --batches 64,512 --repeats 5 --out /tmp/pa.csv
    python bench/bench_prefix_attention.py --modes fwd+bwd --dropout 0.1 --out bench/results/pa_cpu_dropout.csv
    python bench/bench_prefix_attention.py --device cuda            # the GPU users' sizes, bf16, every SDPA backend
    python bench/bench_prefix_attention.py --shapes 4x8,2x5 --heads 2 --head-dim 16   # smoke: tiny (B x S) points
    python bench/bench_prefix_attention.py --seq 128 --kv-heads 4 --causal --out bench/results/pa_cpu_gqa_causal.csv

On the CPU the kernel's x86-64 level (``FASTPROMPT_CPU_ISA``, default the best this CPU supports) and its vector
width are recorded with the machine, next to the CPU model.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import add_ratios, machine, markdown_table, results_path, run_fresh, write_results

from fastprompt.ops import prefix_attention, prefix_attention_varlen

PROVIDERS = ("fastprompt", "fastprompt_packed", "sdpa_concat", "eager_concat")
#: SDPA on the concatenation with one backend pinned (torch.nn.attention.sdpa_kernel): CUDA only.
SDPA_BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION",
                 "sdpa_cudnn": "CUDNN_ATTENTION"}
CUDA_PROVIDERS = PROVIDERS + tuple(SDPA_BACKENDS)
#: The (B, S) points GPU users train at (issue 42): the default on CUDA.
GPU_SHAPES = ((512, 128), (1024, 32), (64, 32))
#: Dense tensor-core peaks (TFLOP/s, without sparsity) by GPU model and dtype: bf16/fp16, fp32 on TF32 tensor
#: cores ("tf32") and on FMA units ("fp32"), from the vendors' data sheets (SXM parts).
PEAK_TFLOPS = {"H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
               "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
               "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}}
DTYPES = ("fp32", "fp16", "bf16")
CONFIG_KEYS = ("dtype", "mode", "dropout", "B", "S", "min_len", "P", "H", "Hkv", "D", "causal")
#: Register width of each x86-64 level of the C++ kernel (FASTPROMPT_CPU_ISA).
VECTOR_BITS = {"x86-64-v4": 512, "x86-64-v3": 256, "baseline": 128}
logger = logging.getLogger("bench_prefix_attention")


def make_inputs(B, S, P, H, Hkv, D, dtype, device, min_len=None, seed=0):
    """q, k, v in transformers' layout, a (Hkv, P, D) prefix, a padding mask with lengths uniform in [min_len, S]
    (default S / 2)."""
    dt = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(device, dt).transpose(1, 2)
    k, v = (torch.randn(B, S, Hkv, D, generator=g).to(device, dt).transpose(1, 2) for _ in range(2))
    pk, pv = (torch.randn(Hkv, P, D, generator=g).to(device, dt) for _ in range(2))
    lengths = torch.randint(S // 2 if min_len is None else min_len, S + 1, (B,), generator=g)
    mask = (torch.arange(S)[None, :] < lengths[:, None]).to(device)
    return q, k, v, pk, pv, mask


def pack(x, mask):
    """(B, heads, S, D) right-padded rows -> (1, heads, N, D) real rows back to back, in transformers' layout."""
    return x.transpose(1, 2)[mask].unsqueeze(0).transpose(1, 2)


def offsets(mask):
    return torch.nn.functional.pad(mask.sum(1).cumsum(0), (1, 0)).to(torch.int32)


def concat_kv(k, v, pk, pv, mask, causal):
    """What prefix-tuning implementations do per layer: expand the prefix over the batch and concatenate."""
    B, P, S = k.shape[0], pk.shape[1], k.shape[2]
    keys = torch.cat([pk.unsqueeze(0).expand(B, -1, -1, -1), k], 2)
    values = torch.cat([pv.unsqueeze(0).expand(B, -1, -1, -1), v], 2)
    tokens = mask[:, None, None, :]
    if causal:
        tokens = tokens & torch.ones(S, S, dtype=torch.bool, device=mask.device).tril()
    tokens = tokens.expand(B, 1, S, S)
    visible = torch.cat([tokens.new_ones(B, 1, S, P), tokens], -1)
    return keys, values, visible


def run_provider(name, q, k, v, pk, pv, mask, scale, backend, dropout_p=0.0, causal=False, packed=None):
    """One forward; ``fastprompt_packed`` runs ``packed`` (q, k, v packed, and the offsets) instead of q, k, v."""
    seed = 0 if dropout_p else None
    if name == "fastprompt":
        return prefix_attention(q, k, v, pk, pv, mask, scale=scale, dropout_p=dropout_p, seed=seed, backend=backend,
                                causal=causal)
    if name == "fastprompt_packed":  # padded width S: the same dropout decisions as the padded batch
        *qkv, cu = packed
        return prefix_attention_varlen(*qkv, pk, pv, scale=scale, dropout_p=dropout_p, seed=seed, backend=backend,
                                       causal=causal, cu_seqlens=cu, max_seqlen=mask.shape[1])
    keys, values, visible = concat_kv(k, v, pk, pv, mask, causal)
    group = q.shape[1] // k.shape[1]
    if name == "sdpa_concat":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, dropout_p=dropout_p,
                                              enable_gqa=group > 1)
    if name in SDPA_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if group > 1:  # not every backend takes enable_gqa
            keys, values = (x.repeat_interleave(group, 1) for x in (keys, values))
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name])):
            if name == "sdpa_flash":  # no mask: every padded key attended to (a floor, not the same output)
                return F.scaled_dot_product_attention(q, keys, values, scale=scale, dropout_p=dropout_p)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale,
                                                  dropout_p=dropout_p)
    keys, values = (x.repeat_interleave(group, 1) for x in (keys, values))  # transformers' eager repeat_kv
    scores = (q @ keys.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return F.dropout(probs, dropout_p) @ values


def setup(provider, mode, B, S, P, H, D, dtype, device, backend="auto", dropout=0.0, Hkv=None, causal=False,
          min_len=None):
    """The inputs of one point and the step that runs ``provider`` once in ``mode`` (after one small call that
    loads the libraries)."""
    Hkv = Hkv or H

    def make(batch):
        q, k, v, pk, pv, mask = make_inputs(batch, S, P, H, Hkv, D, dtype, device, min_len)
        scale = D ** -0.5
        packed = None
        if provider == "fastprompt_packed":  # the same batch, real tokens only
            q, k, v = (pack(x, mask) for x in (q, k, v))
            packed = (q, k, v, offsets(mask))
        if mode == "fwd":
            def call():
                with torch.no_grad():
                    run_provider(provider, q, k, v, pk, pv, mask, scale, backend, causal=causal, packed=packed)
            return call
        leaves = [x.detach().requires_grad_() for x in (q, k, v, pk, pv)]
        grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.device, q.dtype)
        if packed is not None:
            packed = (*leaves[:3], packed[3])

        def call():
            out = run_provider(provider, *leaves, mask, scale, backend, dropout, causal, packed)
            torch.autograd.grad(out, leaves, grad)
        return call

    make(2)()
    return make(B)


def useful_flops(B, S, P, H, Hkv, D, mode, min_len) -> int:
    """The matrix work over the real tokens of the point's batch (the module docstring): QK^T and PV forward,
    three times that with the backward."""
    lengths = make_inputs(B, S, P, H, Hkv, D, "fp32", "cpu", min_len)[5].sum(1)
    forward = 4 * H * D * int((lengths * (P + lengths)).sum())
    return forward * (3 if mode == "fwd+bwd" else 1)


def peak_tflops(device: str, dtype: str) -> float | None:
    """The GPU's dense tensor-core peak for ``dtype`` (fp32 as TF32 when torch allows it), None where unknown."""
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    kind = "tf32" if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32 else dtype
    return next((peaks[kind] for model, peaks in PEAK_TFLOPS.items() if model in name), None)


def max_abs_err(provider, B, S, P, H, Hkv, D, dtype, device, backend, causal, min_len) -> float | str:
    """Largest difference between ``provider``'s forward and SDPA on the concatenation (no dropout), over the real
    tokens' rows (empty for ``sdpa_flash``, which attends to the padding too)."""
    if provider == "sdpa_flash":
        return ""
    q, k, v, pk, pv, mask = make_inputs(B, S, P, H, Hkv, D, dtype, device, min_len)
    packed = (*(pack(x, mask) for x in (q, k, v)), offsets(mask))
    with torch.no_grad():
        want = pack(run_provider("sdpa_concat", q, k, v, pk, pv, mask, D ** -0.5, backend, causal=causal), mask)
        got = run_provider(provider, q, k, v, pk, pv, mask, D ** -0.5, backend, causal=causal, packed=packed)
        got = got if provider == "fastprompt_packed" else pack(got, mask)
        return (got.float() - want.float()).abs().max().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,128,256,512", help="comma-separated batch sizes (at --seq; the CPU's "
                   "default points)")
    p.add_argument("--seq", type=int, default=32, help="S, tokens per sentence")
    p.add_argument("--shapes", default=None,
                   help="comma-separated BxS points, e.g. 512x128,1024x32 (instead of --batches at --seq); default "
                        "on CUDA: " + ",".join(f"{b}x{s}" for b, s in GPU_SHAPES))
    p.add_argument("--min-len", type=int, default=None,
                   help="sentence lengths are uniform in [min-len, seq] (default seq / 2)")
    p.add_argument("--prefix", type=int, default=16, help="P, prefix length")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (grouped-query); default --heads")
    p.add_argument("--causal", action="store_true", help="causal token block (a decoder); the prefix stays visible")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--providers", default=None,
                   help=f"default: {','.join(PROVIDERS)}; on CUDA also {','.join(SDPA_BACKENDS)}")
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
    known = CUDA_PROVIDERS if args.device == "cuda" else PROVIDERS
    providers = [x for x in (args.providers or ",".join(known)).split(",") if x]
    unknown = set(providers) - set(known)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)} on {args.device}; choose from {known}")
    out = args.out or results_path("prefix_attention", args.device)
    P, H, D = args.prefix, args.heads, args.head_dim
    Hkv = args.kv_heads or H
    if args.shapes:
        try:
            shapes = [tuple(int(x) for x in point.lower().split("x")) for point in args.shapes.split(",") if point]
        except ValueError:
            p.error(f"--shapes takes BxS points such as 512x128, got {args.shapes!r}")
    elif args.device == "cuda" and args.batches == p.get_default("batches") and args.seq == p.get_default("seq"):
        shapes = list(GPU_SHAPES)
    else:
        shapes = [(int(b), args.seq) for b in args.batches.split(",")]
    for _, S in shapes:
        min_len = S // 2 if args.min_len is None else args.min_len
        if not 1 <= min_len <= S:
            p.error(f"--min-len must be in [1, S] for every point, got {min_len} at S = {S}")
    if H % Hkv:
        p.error(f"--heads {H} must be a multiple of --kv-heads {Hkv}")
    info = machine()
    if args.device == "cpu":
        from fastprompt.ops import attention_cpu

        if attention_cpu.available(torch.empty(0)):
            info["cpu_isa"] = attention_cpu.isa()
            info["vector_bits"] = VECTOR_BITS.get(info["cpu_isa"])
    rows = []
    peak = peak_tflops(args.device, dtype)
    for B, S in shapes:
        min_len = S // 2 if args.min_len is None else args.min_len
        for mode in args.modes.split(","):
            dropout = args.dropout if mode != "fwd" else 0.0
            config = dict(mode=mode, B=B, S=S, P=P, H=H, Hkv=Hkv, D=D, dtype=dtype, device=args.device,
                          backend=args.backend, dropout=dropout, causal=args.causal, min_len=min_len)
            times = run_fresh(__file__, "setup", config, mode="time", providers=providers, device=args.device,
                              warmup=args.warmup, repeats=repeats, timeout=args.timeout)
            flops = useful_flops(B, S, P, H, Hkv, D, mode, min_len)
            for name in providers:
                mem = run_fresh(__file__, "setup", config, mode="memory", providers=[name], device=args.device,
                                timeout=args.timeout)
                t = times[name]
                tflops = flops / (t.median_ms * 1e-3) / 1e12
                rows.append(dict(bench="prefix_attention", device=args.device, provider=name, dtype=dtype, mode=mode,
                                 dropout=dropout, B=B, S=S, min_len=min_len, P=P, H=H, Hkv=Hkv, D=D,
                                 causal=args.causal,
                                 median_ms=round(t.median_ms, 4), p20_ms=round(t.p20_ms, 4), p80_ms=round(t.p80_ms, 4),
                                 peak_mb=round(mem["peak_mb"], 3), repeats=t.repeats,
                                 max_abs_err_vs_sdpa=max_abs_err(name, B, S, P, H, Hkv, D, dtype, args.device,
                                                                 args.backend, args.causal, min_len),
                                 isa=info.get("cpu_isa", ""), tflops=float(f"{tflops:.4g}"),
                                 peak_fraction="" if peak is None else float(f"{tflops / peak:.4g}")))
                logger.info("B=%d S=%d %-8s %-14s %9.3f ms  %9.2f MiB  %8.3f TFLOP/s", B, S, mode, name, t.median_ms,
                            mem["peak_mb"], tflops)
            add_ratios(rows, "sdpa_concat", CONFIG_KEYS)
            write_results(rows, out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["B", "S", "mode", "provider", "median_ms", "peak_mb", "tflops", "peak_fraction",
                                "time_vs_baseline", "mem_vs_baseline"]))
    isa = f", kernel {info['cpu_isa']} ({info['vector_bits']}-bit vectors)" if info.get("vector_bits") else ""
    device = info.get("gpu", info["cpu"]) if args.device == "cuda" else info["cpu"]
    print(f"\n{args.device} ({device}{isa}), {dtype}, P={P} H={H} Hkv={Hkv} D={D} causal={args.causal}, "
          f"dropout in fwd+bwd {args.dropout}, {info['threads']} threads; wrote {out}")


if __name__ == "__main__":
    sys.exit(main())

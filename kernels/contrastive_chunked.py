"""The stripe path of the fused contrastive loss: its gradient in three N²·d products, from a stored row chunk of the
similarity matrix, with one Triton epilogue (``_epilogue_kernel`` of :mod:`fastprompt.kernels.contrastive_loss`, where
all the loss's kernels live) and cuBLAS products. No autograd here (``fastprompt/ops/contrastive.py`` calls
:func:`stripe`); the problem, the logits and the raw-space gradients are those of
:mod:`fastprompt.kernels.contrastive_loss` and ``csrc/contrastive_loss.cpp``.

For a chunk of R rows of a problem (rows x against the columns c = cat(segments), M of them) the raw products of
every Matryoshka prefix, S^t = x[:, :d_t] · c[:, :d_t]ᵀ, are stored once, fp32, as D stripes of R x M (the budget
``STRIPE_KIB`` of the epilogue's launch config bounds R, so the memory is O(R·M), never O(N·M)). The epilogue kernel
(one program per BLOCK_M rows, every column) then

1. (``STATS``) streams the stripe: per row and dimension the online log-sum-exp, the target's cosine and the hardest
   negative, with the masks of the streaming kernels (text ids, a guide's cosines, the model-scored margin);
2. (``GRAD``) turns it into dS = cce·softmax - cdiag·[target] + chg·[hardest] (the coefficients from the per-row
   upstream weight, the Matryoshka weights and the statistics, computed in the kernel), the per-row and per-column
   sums Q^t = Σ dS^t·cos^t (the normalisation's projection), and writes W^t = Σ_{u ≥ t} dS^u ∘ f^u_i g^u_j (f, g:
   the inverse prefix norms) in the input dtype *in place* over S^t: the first half of each fp32 row for 16-bit
   inputs (a CTA barrier between a tile's last read of S^t and its write: the narrower values land on bytes of
   columns read earlier).

Then cuBLAS, per dimension chunk d_{t-1}..d_t: E_rows[chunk] = W^t · c and E_cols += W^tᵀ · x[chunk] (fp32 results),
the columns' gradient accumulated over the chunks in a fixed order (deterministic, no atomics). Products per call: S
(d per row-column pair; Σ_t d_t on the chunked variant's cuBLAS, which recomputes each prefix) and 2·d for the
gradients: 3 N·M·d instead of the streaming kernels' 5.

Two variants fill the stripe:

- ``"chunked"`` (the backend of that name): S by ``torch.mm`` (cuBLAS, fp32 output), then one epilogue launch per
  chunk doing both passes (siglip-kernel's and Liger-Kernel's fused-linear-cross-entropy design);
- ``"triton"`` (the Triton backend's gradient in the forward): S by the statistics kernel of
  :mod:`fastprompt.kernels.contrastive_loss`, which stores it while it computes the statistics on tensor cores with
  the columns split across programs (every SM busy at every N), then the epilogue's pass 2 only.

fp16 keeps the inverse norms out of W (unit copies of the operands for the products, W carrying only the prefix-norm
ratios r^t / r^last, ≥ 1) and scales W by a power of two computed on the device, so that the small softmax terms do
not flush to zero and a zero row's 1/eps norm does not overflow the others; bf16 and fp32 have fp32's range and carry
the inverse norms in W directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
from fastprompt.kernels import contrastive_loss as tk
from fastprompt.kernels.contrastive_loss import (
    config,
    device_table,
    power_of_two_scale,
    shape_key,
    split_config,
)
from fastprompt.kernels.contrastive_loss import stats as streaming_stats

#: What fills a chunk's stripe: the statistics kernel on tensor cores ("triton") or cuBLAS ("chunked").
VARIANTS = ("triton", "chunked")


# ------------------------------------------------------------------------------------------------
# host side


@dataclass
class Coefficients:
    """What turns a problem's statistics into dS (the per-row coefficients of ``fastprompt/ops/contrastive.py``'s
    ``_coefficients``, computed in the epilogue): cce = gw·w_t·ce_scale, chg = gw·w_t·hinge_weight where the hinge is
    active, cdiag = cce·has_target + chg; the normaliser is the problem's log-sum-exp, or its logaddexp with
    ``extra`` (the other problem's, for the joint symmetric loss)."""

    gw: Union[float, torch.Tensor]  # the per-row upstream weight: a number (uniform: .mean()/.sum()) or (n,)
    weights: torch.Tensor  # (D,) Matryoshka weights, fp32, on the device
    ce_scale: float
    hinge_weight: float = 0.0
    hinge_margin: float = 0.0
    has_target: bool = True
    extra: Optional[torch.Tensor] = None  # (D, n)


_CHOOSER = None


def set_variant_chooser(chooser) -> None:
    """Install ``chooser(key) -> "triton" | "chunked"`` (key: :func:`variant_key`) as ``auto``'s choice on CUDA
    (None restores the default: the tuned table's measured choice, else :func:`default_variant`)."""
    global _CHOOSER
    _CHOOSER = chooser


def variant_key(dtype: torch.dtype, n: int, m: int, d: int, grad: bool) -> dict:
    """The shape class ``auto``'s choice is keyed by: the tuned table's ``choices`` of this op
    (:mod:`fastprompt.kernels.tuning`: precision tag, d, rows, whether a gradient is taken)."""
    return {"dtype": shape_key(dtype, n, m, d)["dtype"], "d": d, "n": n, "grad": grad}


def default_variant(key: dict, m: int) -> str:
    """The heuristic until a GPU's table says otherwise: with a gradient and at least 2^24 similarities (4096²),
    the chunked variant (the S product is a large GEMM, where cuBLAS is at its best and the stripe pass reads S
    twice instead of once); else the fused Triton kernels (fewer launches; without a gradient they stream, with no
    stripe)."""
    return "chunked" if key["grad"] and key["n"] * m >= 1 << 24 else "triton"


def choose_variant(dtype: torch.dtype, n: int, m: int, d: int, grad: bool, device) -> str:
    """``auto``'s variant on CUDA: the installed chooser, else the GPU's measured choice within its reach (the tuned
    table's "plain" side is this op's chunked variant), else :func:`default_variant`."""
    key = variant_key(dtype, n, m, d, grad)
    if _CHOOSER is not None:
        return _CHOOSER(key)
    if torch.device(device).type == "cuda":
        from fastprompt.kernels import tuning

        choice = tuning.measured_choice("contrastive_loss", key, device)
        if choice is not None:
            return "chunked" if choice.backend == "plain" else "triton"
    return default_variant(key, m)


def chunk_rows(n: int, m: int, d: int, ndims: int, dtype: torch.dtype, device, variant: str) -> int:
    """Rows per chunk: as many as the stripe budget holds (D·M fp32 per row), a multiple of the row tiles; 0 when
    not even one row tile fits, where the Triton variant streams instead (the chunked variant then takes one row
    tile over budget)."""
    key = shape_key(dtype, n, m, d, ndims)
    ecfg = config(dtype, kernel="epilogue", key=key, device=device)
    align = ecfg.tiles["BLOCK_M"]
    if variant == "triton":
        align = max(align, config(dtype, kernel="stats", key=key, device=device).tiles["BLOCK_M"])
    rows = ecfg.tiles["STRIPE_KIB"] * 1024 // (4 * ndims * m) // align * align
    if rows < align:
        return 0 if variant == "triton" else align
    return min(rows, -(-n // align) * align)


def _mm_out(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b with an fp32 result for inputs of any dtype: cuBLAS's fp32 output for fp16/bf16 on CUDA; the same
    products upcast on the CPU (the interpreter's tests: exact in fp32, as the GPU's fp32 accumulation)."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif a.is_cuda:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        torch.mm(a.float(), b.float(), out=out)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, block_rows: int) -> None:
    """acc += a @ b in fp32; for 16-bit inputs through fp32 results of at most ``block_rows`` rows at a time (the
    temporary stays within the stripe budget)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    for i in range(0, acc.shape[0], block_rows):
        acc[i:i + block_rows] += _mm(a[i:i + block_rows], b)


def _cat(parts):
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def stripe(x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own, a_in, a_own, *,
           variant: str, track_hard: bool, coef: Optional[Coefficients] = None, stats_in=None):
    """The statistics and/or the raw-space gradient sums of a problem (the arguments of
    :func:`fastprompt.kernels.contrastive_loss.stats`) from stored row chunks of its similarity matrix.

    ``stats_in``: the problem's (lse, pos, hard, hidx) when known (a backward: only dS is computed), else they are
    computed (and returned). ``coef``: the dS coefficients; None for statistics only (the chunked variant's forward
    without a gradient). Returns ``(stats, grads)``: stats (lse, pos, hard, hidx) (D, n) each, or ``stats_in``;
    grads (E_rows (n, d), Q_rows (D, n), E_cols (M, d), Q_cols (D, M)) fp32, as the streaming ``grads``, or None.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "triton" and coef is None:
        raise ValueError("the Triton variant stores a stripe only for a gradient; its statistics stream")
    n, d = x.shape
    D = len(dims)
    dev, dtype = x.device, x.dtype
    f32 = dict(device=dev, dtype=torch.float32)
    m0 = cols[0].shape[0]
    c = _cat([z.contiguous() for z in cols])
    m = c.shape[0]
    rc = _cat([r.to(torch.float32).t() for r in rcols]).t().contiguous()  # (D, M)
    rx = rx.to(torch.float32).contiguous()
    ids = None if col_ids[0] is None else _cat(list(col_ids)).contiguous()
    gc = None if gcols[0] is None else _cat(list(gcols)).contiguous()
    rows_per = chunk_rows(n, m, d, D, dtype, dev, variant)
    if rows_per == 0:
        raise ValueError("the stripe does not fit its budget: use the streaming kernels")
    aligned = all(v % 16 == 0 for v in (n, m, 0 if gx is None else gx.shape[1]))  # the epilogue's strides
    ecfg = config(dtype, kernel="epilogue", key=shape_key(dtype, n, m, d, D), device=dev, aligned=aligned)
    eflags, elaunch, ehost = split_config(ecfg, dtype, D)
    bm = eflags["BLOCK_M"]
    buf = torch.empty((D, rows_per, m), **f32)  # the stripe, and W in place
    wbuf = buf if dtype == torch.float32 else buf.view(dtype)  # (D, R, 2M): W^t in the first half of each row

    compute_stats = stats_in is None
    if compute_stats:  # poisoned: an entry the kernels do not write stays NaN / -1
        lse, pos, hard = (torch.full((D, n), float("nan"), **f32) for _ in range(3))
        hidx = torch.full((D, n), -1, device=dev, dtype=torch.int64)
    else:
        lse, pos, hard, hidx = (t.contiguous() for t in stats_in)
        lse, pos, hard = lse.to(torch.float32), pos.to(torch.float32), hard.to(torch.float32)
    grad = coef is not None
    dummy = device_table((0.0,), torch.float32, dev)
    if grad:
        e_rows = torch.full((n, d), float("nan"), **f32)  # poisoned: every chunk writes its rows
        e_rows[:, dims[-1]:] = 0.0  # past the largest prefix: no gradient
        e_cols = torch.zeros((m, d), **f32)
        q_rows = torch.full((D, n), float("nan"), **f32)
        q_cols = torch.zeros((D, m), **f32)
        if dtype == torch.float16:  # unit operands; W carries the prefix ratios and a device-side scale
            xg = (x.to(torch.float32) * rx[-1][:, None]).to(dtype)
            cg = (c.to(torch.float32) * rc[-1][:, None]).to(dtype)
            wr, wc = rx / rx[-1], rc / rc[-1]
            gwmax = coef.gw.abs().amax() if isinstance(coef.gw, torch.Tensor) else abs(coef.gw)
            cmax = (gwmax * coef.weights.abs().amax() * (abs(coef.ce_scale) + abs(coef.hinge_weight))
                    * wr.amax() * wc.amax())
            scale = power_of_two_scale(cmax)
        else:
            xg, cg, wr, wc = x, c, rx, rc
            scale = device_table((1.0,), torch.float32, dev)
        weights = coef.weights.to(torch.float32)
        extra = coef.extra.to(torch.float32).contiguous() if coef.extra is not None else dummy
        gw_t = coef.gw.to(torch.float32).contiguous() if isinstance(coef.gw, torch.Tensor) else dummy
        coef_args = dict(has_extra=int(coef.extra is not None), has_gw=int(isinstance(coef.gw, torch.Tensor)),
                         gw_const=0.0 if isinstance(coef.gw, torch.Tensor) else float(coef.gw),
                         ce_scale=float(coef.ce_scale), hinge_weight=float(coef.hinge_weight),
                         hinge_margin=float(coef.hinge_margin), has_target=int(coef.has_target))
        # the columns' fp32 temporaries of the 16-bit products: at most an eighth of the stripe budget
        block = max(1, ehost["STRIPE_KIB"] * 1024 // (32 * d))
    else:
        coef_args = dict(has_extra=0, has_gw=0, gw_const=0.0, ce_scale=0.0, hinge_weight=0.0, hinge_margin=0.0,
                         has_target=0)
    thr_t = thr.to(torch.float32).contiguous() if thr is not None else None
    margin_mode = 0 if thr is None else (2 if gx is not None else 1)
    dummy_ids = device_table((0,), torch.int64, dev)
    for r0 in range(0, n, rows_per):
        r1 = min(n, r0 + rows_per)
        rows = r1 - r0
        xc = x[r0:r1]
        if variant == "triton":  # S on tensor cores while the statistics are computed; pass 2 only
            st = streaming_stats(xc, rx[:, r0:r1], cols, rcols, dims, None if tid is None else tid[r0:r1], col_ids,
                                 None if gx is None else gx[r0:r1], gcols,
                                 None if thr_t is None else thr_t[:, r0:r1], label_offset + r0, inv_tau, bias_own,
                                 a_in, a_own, track_hard, store=buf)
            if compute_stats:
                for out, part in zip((lse, pos, hard, hidx), st):
                    out[:, r0:r1] = part
            run_stats = False
        else:  # S by cuBLAS (each prefix from scratch: Σ_t d_t products)
            for t, dt in enumerate(dims):
                _mm_out(buf[t, :rows], xc[:, :dt], c[:, :dt].t())
            run_stats = compute_stats
        grid = (triton.cdiv(rows, bm),)
        qc_part = torch.empty((grid[0], D, m), **f32) if grad else dummy
        tk._epilogue_kernel[grid](
            buf, wbuf, rx[:, r0:], rc, wr[:, r0:] if grad else rx[:, r0:], wc if grad else rc,
            tid[r0:] if tid is not None else dummy_ids, ids if ids is not None else dummy_ids,
            gx[r0:] if gx is not None else xc, gc if gc is not None else xc,
            thr_t[:, r0:] if thr_t is not None else rx[:, r0:], lse[:, r0:], pos[:, r0:], hard[:, r0:],
            hidx[:, r0:], extra[:, r0:] if grad and coef.extra is not None else dummy,
            gw_t[r0:] if grad and isinstance(coef.gw, torch.Tensor) else dummy,
            weights if grad else dummy, scale if grad else dummy, q_rows[:, r0:] if grad else dummy,
            qc_part, rows, m0, m, gx.shape[1] if gx is not None else 0, D, n, buf.stride(0), buf.stride(1),
            wbuf.stride(0), wbuf.stride(1), gx.stride(0) if gx is not None else 0,
            gc.stride(0) if gc is not None else 0, label_offset + r0, float(inv_tau), float(bias_own), float(a_in),
            float(a_own), int(bool(track_hard)), int(tid is not None), margin_mode, **coef_args,
            STATS=run_stats, GRAD=grad, **eflags, **elaunch)
        if not grad:
            continue
        q_cols += qc_part.sum(0)
        lo = 0
        for t, hi in enumerate(dims):
            w_t = wbuf[t, :rows, :m]
            if lo == 0 and hi == d:  # one prefix: the rows' gradient straight into its (contiguous) rows
                _mm_out(e_rows[r0:r1], w_t, cg)
            else:
                e_rows[r0:r1, lo:hi] = _mm(w_t, cg[:, lo:hi])
            _addmm_(e_cols[:, lo:hi], w_t.t(), xg[r0:r1, lo:hi], block)
            lo = hi
    stats_out = (lse, pos, hard, hidx) if compute_stats else stats_in
    if not grad:
        return stats_out, None
    if dtype == torch.float16:
        e_rows.mul_((rx[-1] / scale)[:, None])
        e_cols.mul_((rc[-1] / scale)[:, None])
    return stats_out, (e_rows, q_rows, e_cols, q_cols)

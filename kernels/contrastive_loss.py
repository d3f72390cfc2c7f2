"""Triton kernels of the fused contrastive loss (``fastprompt.ops.contrastive_loss``): the statistics of a problem
(forward) and its gradients (a backward row pass and column pass), with their launchers and ahead-of-time specs.
No autograd here: ``fastprompt/ops/contrastive.py`` builds the problems, wraps the kernels in a torch.library op and
finishes the gradients. The problem, the logits and the raw-space gradients are those of the C++ kernels
(``csrc/contrastive_loss.cpp`` describes them); how the Triton kernels work: ``docs/ops/contrastive_loss.md`` ("The
Triton kernels in detail").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from fastprompt.kernels._common import (
    TRITON_TYPE,
    LaunchConfig,
    check_interpreted,
    dot_precision,
    interpreting,
    upcast,
)
from fastprompt.kernels.aot import KernelSpec

_INT_MAX = tl.constexpr(2147483647)


@triton.jit
def _row_ptrs(X, r0, stride, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pointers to the first BLOCK_K columns of rows r0..r0+BLOCK_R of X. The block's base is offset in int64
    (N·d may exceed 2^31); offsets inside the block are int32."""
    return (X + tl.cast(r0, tl.int64) * stride + (tl.arange(0, BLOCK_R) * stride)[:, None]
            + tl.arange(0, BLOCK_K)[None, :])


@triton.jit
def _dot_range(A, B, a0, b0, amask, bmask, k_lo, k_hi, stride_a, stride_b, acc,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc + A[a0:a0+BLOCK_M, k_lo:k_hi] . B[b0:b0+BLOCK_N, k_lo:k_hi]^T, fp32 accumulation."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = _row_ptrs(A, a0, stride_a, BLOCK_M, BLOCK_K)
    b_ptrs = _row_ptrs(B, b0, stride_b, BLOCK_N, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = (k0 + ks) < k_hi
        a = tl.load(a_ptrs + k0, mask=amask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=bmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _segment(SEG: tl.constexpr, C0, RC0, IDS0, GC0, stride_c0, stride_gc0, m0, C1, RC1, IDS1, GC1, stride_c1,
             stride_gc1, m1):
    """Column segment SEG: (columns, their inverse prefix norms, text ids, guide vectors, the row strides of the
    columns and of the guide vectors, rows, global index of its first column): the targets block, then the
    negatives block."""
    if SEG == 0:
        return C0, RC0, IDS0, GC0, stride_c0, stride_gc0, m0, 0
    else:
        return C1, RC1, IDS1, GC1, stride_c1, stride_gc1, m1, m0


@triton.jit
def _tile_roles(rows, cols, label_offset, m0, SEG: tl.constexpr):
    """(target, own negative) masks of a (rows x columns) tile: row i's target is column label_offset + i of the
    targets block, its own negatives the columns j·m0 + label_offset + i of the negatives block."""
    label = rows + label_offset
    if SEG == 0:
        target = cols[None, :] == label[:, None]
        own = cols[None, :] < 0  # none
    else:
        target = cols[None, :] < 0
        own = (cols % m0)[None, :] == label[:, None]
    return target, own


@triton.jit
def _static_mask(rows, rmask, cols, cmask, target, TID, IDS, GX, GC, THR, dg, stride_gx, stride_gc, r0, c0,
                 has_ids, margin_mode, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """The columns left out of every dimension's softmax: out of range, the same text id as the row's target or
    none (id < 0), a guide cosine above the row's threshold (margin_mode 2); never the target."""
    out = (~cmask)[None, :] | (~rmask)[:, None]
    if has_ids != 0:
        tid = tl.load(TID + rows, mask=rmask, other=-1)
        ids = tl.load(IDS + cols, mask=cmask, other=-1)
        out = out | (ids[None, :] == tid[:, None]) | (ids < 0)[None, :]
    if margin_mode == 2:
        g = _dot_range(GX, GC, r0, c0, rmask, cmask, 0, dg, stride_gx, stride_gc,
                       tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
        thr = tl.load(THR + rows, mask=rmask, other=0.0)
        out = out | (g > thr[:, None])
    return out & ~target


@triton.jit
def _tile_masks(rows, rmask, cols, cmask, r0, c0, label_offset, m0, TID, IDS, GX, GC, THR, dg, stride_gx, stride_gc,
                has_ids, margin_mode, SEG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """The head of every tile of every kernel (rows r0.. against columns c0.. of segment SEG): the (target, own
    negative) roles and the static mask shared by the tile's dimensions."""
    target, own = _tile_roles(rows, cols, label_offset, m0, SEG)
    static = _static_mask(rows, rmask, cols, cmask, target, TID, IDS, GX, GC, THR, dg, stride_gx, stride_gc, r0, c0,
                          has_ids, margin_mode, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
    return target, own, static


@triton.jit
def _logits(cos, target, own, masked, inv_tau, bias_own, a_in, a_own):
    """cos·(inv_tau + a_in) for an in-batch negative, cos·(inv_tau + a_own) + bias for an own negative, cos·inv_tau
    for the target, -inf for a masked column (the hardness penalty a·cos is a constant of the softmax)."""
    lg = cos * (inv_tau + a_in)
    lg = tl.where(own, cos * (inv_tau + a_own) + bias_own, lg)
    lg = tl.where(target, cos * inv_tau, lg)
    return tl.where(masked, float("-inf"), lg)


@triton.jit
def _dim_mask(static, cos, target, THR, t, n_rows, rows, rmask, margin_mode):
    """The static mask plus, scored by the model (margin_mode 1), the cosines above the row's threshold at
    dimension t."""
    masked = static
    if margin_mode == 1:
        thr = tl.load(THR + t * n_rows + rows, mask=rmask, other=0.0)
        masked = masked | ((cos > thr[:, None]) & ~target)
    return masked


@triton.jit
def _pick(tile, sel):
    """Column ``sel`` (a (1, DPAD) one-hot) of a (rows, DPAD) tile of per-dimension values, as a vector."""
    return tl.sum(tl.where(sel, tile, 0.0), axis=1)


@triton.jit
def _prefix_tile(X, C, RX, RC, DIMS, THR, static, target, rows, rmask, cols, cmask, r0, c0, acc, k0, t, n_rows, m_seg,
                 stride_x, stride_c, margin_mode, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """Dimension t of a tile: the raw products advanced from the prefix k0 to d_t (the dimensions share one sweep
    over d), then that prefix's inverse norms, cosines and mask: (acc, d_t, rx, rc, cos, masked)."""
    k1 = tl.load(DIMS + t)
    acc = _dot_range(X, C, r0, c0, rmask, cmask, k0, k1, stride_x, stride_c, acc,
                     BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
    rx = tl.load(RX + t * n_rows + rows, mask=rmask, other=0.0)
    rc = tl.load(RC + t * m_seg + cols, mask=cmask, other=0.0)
    cos = acc * rx[:, None] * rc[None, :]
    masked = _dim_mask(static, cos, target, THR, t, n_rows, rows, rmask, margin_mode)
    return acc, k1, rx, rc, cos, masked


@triton.jit
def _stats_kernel(X, RX, C0, RC0, C1, RC1, DIMS, TID, IDS0, IDS1, GX, GC0, GC1, THR, LSE, POS, HARD, HIDX,
                  n_rows, m0, m1, d, dg, ndims, stride_x, stride_c0, stride_c1, stride_gx, stride_gc0, stride_gc1,
                  label_offset, inv_tau, bias_own, a_in, a_own, track_hard, has_ids, margin_mode,
                  NSEG: tl.constexpr, DPAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """Per row and dimension: online log-sum-exp, the target's cosine, the hardest negative (largest cosine left
    in the softmax other than the target; exact ties keep the lowest column). The prefixes share one sweep over d."""
    r0 = tl.program_id(0) * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    dcol = tl.arange(0, DPAD)[None, :]
    m = tl.full((BLOCK_M, DPAD), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M, DPAD), tl.float32)
    pos = tl.zeros((BLOCK_M, DPAD), tl.float32)
    best = tl.full((BLOCK_M, DPAD), float("-inf"), tl.float32)
    best_idx = tl.full((BLOCK_M, DPAD), -1, tl.int32)
    for seg in tl.static_range(NSEG):
        C, RC, IDS, GC, stride_c, stride_gc, m_seg, base = _segment(seg, C0, RC0, IDS0, GC0, stride_c0, stride_gc0,
                                                                    m0, C1, RC1, IDS1, GC1, stride_c1, stride_gc1, m1)
        for c0 in range(0, m_seg, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            cmask = cols < m_seg
            target, own, static = _tile_masks(rows, rmask, cols, cmask, r0, c0, label_offset, m0, TID, IDS, GX, GC,
                                              THR, dg, stride_gx, stride_gc, has_ids, margin_mode, seg, BLOCK_M,
                                              BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            k0 = 0
            for t in range(ndims):
                acc, k0, rx, rc, cos, masked = _prefix_tile(
                    X, C, RX, RC, DIMS, THR, static, target, rows, rmask, cols, cmask, r0, c0, acc, k0, t, n_rows,
                    m_seg, stride_x, stride_c, margin_mode, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
                sel = dcol == t
                pos += tl.where(sel, tl.sum(tl.where(target, cos, 0.0), axis=1)[:, None], 0.0)
                if track_hard != 0:
                    cand = tl.where(masked | target, float("-inf"), cos)
                    tmax = tl.max(cand, axis=1)
                    gcol = cols + base
                    targ = tl.min(tl.where(cand == tmax[:, None], gcol[None, :], _INT_MAX), axis=1)
                    # strict: an equal value in a later tile keeps the lower index; -inf (nothing left) never wins
                    upd = sel & (tmax > _pick(best, sel))[:, None]
                    best = tl.where(upd, tmax[:, None], best)
                    best_idx = tl.where(upd, targ[:, None], best_idx)
                lg = _logits(cos, target, own, masked, inv_tau, bias_own, a_in, a_own)
                m_t = _pick(m, sel)
                m_new = tl.maximum(m_t, tl.max(lg, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing finite yet: add exp(-inf) = 0
                s_new = _pick(s, sel) * tl.exp(m_t - shift) + tl.sum(tl.exp(lg - shift[:, None]), axis=1)
                m = tl.where(sel, m_new[:, None], m)
                s = tl.where(sel, s_new[:, None], s)
    out = dcol * n_rows + rows[:, None]
    omask = rmask[:, None] & (dcol < ndims)
    tl.store(LSE + out, m + tl.log(tl.where(s > 0, s, 1.0)), mask=omask)  # (s = 0 only where nothing is stored)
    tl.store(POS + out, pos, mask=omask)
    if track_hard != 0:
        tl.store(HARD + out, best, mask=omask)
        tl.store(HIDX + out, best_idx.to(tl.int64), mask=omask)


@triton.jit
def _zeroed_accumulator(ACC, start, mask, stride, d, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Zero this program's fp32 accumulator rows start..start+BLOCK_R of ACC (rows where ``mask``) over the
    whole d, then a CTA barrier; returns their pointers (from :func:`_row_ptrs`)."""
    ptrs = _row_ptrs(ACC, start, stride, BLOCK_R, BLOCK_K)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, d, BLOCK_K):
        tl.store(ptrs + k0, tl.zeros((BLOCK_R, BLOCK_K), tl.float32), mask=mask[:, None] & (k0 + ks < d)[None, :])
    tl.debug_barrier()
    return ptrs


@triton.jit
def _accumulate_unit(acc_ptrs, amask, w, v_ptrs, vmask, rv, k_hi, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc[:, :k_hi] += w @ unit(v)[:, :k_hi] in d-chunks, in the fp32 accumulator rows at ``acc_ptrs``. The unit
    vectors are the raw rows scaled by their inverse (prefix) norms ``rv`` in fp32, then cast back to the input
    dtype (so zero rows stay zero) for the tensor-core product."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, k_hi, BLOCK_K):
        kmask = (k0 + ks) < k_hi
        v = tl.load(v_ptrs + k0, mask=vmask[:, None] & kmask[None, :], other=0.0)
        v = (v.to(tl.float32) * rv[:, None]).to(v_ptrs.dtype.element_ty)  # unit vectors
        if UPCAST:
            v = v.to(tl.float32)
        omask = amask[:, None] & kmask[None, :]
        old = tl.load(acc_ptrs + k0, mask=omask, other=0.0)
        tl.store(acc_ptrs + k0, tl.dot(w.to(v.dtype), v, old, input_precision=DOT_PREC), mask=omask)


@triton.jit
def _ds_tile(cos, target, own, masked, rows, rmask, cmask, gcol, t, n_rows, L, CCE, CDIAG, CHG, HIDX, inv_tau,
             bias_own, a_in, a_own):
    """dLoss/dcos of dimension t: cce · softmax (masked columns: exp(-inf) = 0), -cdiag at the target, +chg at
    the hardest negative; 0 outside the rows and columns."""
    o = t * n_rows + rows
    lse = tl.load(L + o, mask=rmask, other=0.0)
    cce = tl.load(CCE + o, mask=rmask, other=0.0)
    cdiag = tl.load(CDIAG + o, mask=rmask, other=0.0)
    chg = tl.load(CHG + o, mask=rmask, other=0.0)
    hidx = tl.load(HIDX + o, mask=rmask, other=-1).to(tl.int32)
    lg = _logits(cos, target, own, masked, inv_tau, bias_own, a_in, a_own)
    ds = cce[:, None] * tl.exp(lg - lse[:, None])
    ds -= tl.where(target, cdiag[:, None], 0.0)
    ds += tl.where(gcol[None, :] == hidx[:, None], chg[:, None], 0.0)
    return tl.where(rmask[:, None] & cmask[None, :], ds, 0.0)


@triton.jit
def _bwd_rows_kernel(X, RX, C0, RC0, C1, RC1, DIMS, TID, IDS0, IDS1, GX, GC0, GC1, THR, L, CCE, CDIAG, CHG, HIDX,
                     DA, Q, SCALE, n_rows, m0, m1, d, dg, ndims, stride_x, stride_c0, stride_c1, stride_gx,
                     stride_gc0, stride_gc1, stride_da, label_offset, inv_tau, bias_own, a_in, a_own, has_ids,
                     margin_mode,
                     NSEG: tl.constexpr, DPAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """DA[rows] = Σ_t Σ_j dS^t_ij (r^t_i / r^last_i) unit_t(c_j)[:d_t] (fp32, this program's rows only; the host
    multiplies by r^last) and Q[t, rows] = Σ_j dS^t_ij cos^t_ij."""
    r0 = tl.program_id(0) * BLOCK_M
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    dcol = tl.arange(0, DPAD)[None, :]
    r_last = tl.load(RX + (ndims - 1) * n_rows + rows, mask=rmask, other=1.0)
    grad_scale = tl.load(SCALE)
    da_base = _zeroed_accumulator(DA, r0, rmask, stride_da, d, BLOCK_M, BLOCK_K)
    q = tl.zeros((BLOCK_M, DPAD), tl.float32)
    for seg in tl.static_range(NSEG):
        C, RC, IDS, GC, stride_c, stride_gc, m_seg, base = _segment(seg, C0, RC0, IDS0, GC0, stride_c0, stride_gc0,
                                                                    m0, C1, RC1, IDS1, GC1, stride_c1, stride_gc1, m1)
        for c0 in range(0, m_seg, BLOCK_N):
            cols = c0 + tl.arange(0, BLOCK_N)
            cmask = cols < m_seg
            target, own, static = _tile_masks(rows, rmask, cols, cmask, r0, c0, label_offset, m0, TID, IDS, GX, GC,
                                              THR, dg, stride_gx, stride_gc, has_ids, margin_mode, seg, BLOCK_M,
                                              BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            k0 = 0
            for t in range(ndims):
                acc, k0, rx, rc, cos, masked = _prefix_tile(
                    X, C, RX, RC, DIMS, THR, static, target, rows, rmask, cols, cmask, r0, c0, acc, k0, t, n_rows,
                    m_seg, stride_x, stride_c, margin_mode, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
                ds = _ds_tile(cos, target, own, masked, rows, rmask, cmask, cols + base, t, n_rows, L, CCE, CDIAG,
                              CHG, HIDX, inv_tau, bias_own, a_in, a_own)
                q += tl.where(dcol == t, tl.sum(ds * cos, axis=1)[:, None], 0.0)
                w = (ds * (rx / r_last * grad_scale)[:, None]).to(C.dtype.element_ty)
                _accumulate_unit(da_base, rmask, w, _row_ptrs(C, c0, stride_c, BLOCK_N, BLOCK_K), cmask, rc, k0,
                                 BLOCK_K, UPCAST, DOT_PREC)
                tl.debug_barrier()  # the next product re-reads what other threads of this program stored
    tl.store(Q + dcol * n_rows + rows[:, None], q, mask=rmask[:, None] & (dcol < ndims))


@triton.jit
def _bwd_cols_kernel(X, RX, C, RC, DIMS, TID, IDS, GX, GC, THR, L, CCE, CDIAG, CHG, HIDX, DB, QC, SCALE,
                     n_rows, m0, m_seg, base, d, dg, ndims, stride_x, stride_c, stride_gx, stride_gc, stride_db,
                     label_offset, inv_tau, bias_own, a_in, a_own, has_ids, margin_mode,
                     SEG: tl.constexpr, DPAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """DB[cols] = Σ_t Σ_i dS^t_ij (r^t_j / r^last_j) unit_t(x_i)[:d_t] and QC[t, cols] = Σ_i dS^t_ij cos^t_ij for
    one segment's column block (this program's columns only)."""
    c0 = tl.program_id(0) * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    cmask = cols < m_seg
    dcol = tl.arange(0, DPAD)[None, :]
    r_last = tl.load(RC + (ndims - 1) * m_seg + cols, mask=cmask, other=1.0)
    grad_scale = tl.load(SCALE)
    db_base = _zeroed_accumulator(DB, c0, cmask, stride_db, d, BLOCK_N, BLOCK_K)
    q = tl.zeros((BLOCK_N, DPAD), tl.float32)
    for r0 in range(0, n_rows, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = rows < n_rows
        target, own, static = _tile_masks(rows, rmask, cols, cmask, r0, c0, label_offset, m0, TID, IDS, GX, GC, THR,
                                          dg, stride_gx, stride_gc, has_ids, margin_mode, SEG, BLOCK_M, BLOCK_N,
                                          BLOCK_K, UPCAST, DOT_PREC)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k0 = 0
        for t in range(ndims):
            acc, k0, rx, rc, cos, masked = _prefix_tile(
                X, C, RX, RC, DIMS, THR, static, target, rows, rmask, cols, cmask, r0, c0, acc, k0, t, n_rows, m_seg,
                stride_x, stride_c, margin_mode, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
            ds = _ds_tile(cos, target, own, masked, rows, rmask, cmask, cols + base, t, n_rows, L, CCE, CDIAG, CHG,
                          HIDX, inv_tau, bias_own, a_in, a_own)
            q += tl.where(dcol == t, tl.sum(ds * cos, axis=0)[:, None], 0.0)
            w = tl.trans((ds * (rc / r_last * grad_scale)[None, :]).to(X.dtype.element_ty))  # (cols, rows)
            _accumulate_unit(db_base, cmask, w, _row_ptrs(X, r0, stride_x, BLOCK_M, BLOCK_K), rmask, rx, k0,
                             BLOCK_K, UPCAST, DOT_PREC)
            tl.debug_barrier()
    tl.store(QC + dcol * m_seg + cols[:, None], q, mask=cmask[:, None] & (dcol < ndims))


# ------------------------------------------------------------------------------------------------
# host side


check_interpreted(_stats_kernel, _bwd_rows_kernel, _bwd_cols_kernel)


def config(dtype: torch.dtype, interpret: bool) -> LaunchConfig:
    """Tile sizes (constexprs) and launch options. Interpreter: small tiles (each program instance costs
    ~20 ms)."""
    if interpret:
        return LaunchConfig(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32), num_warps=4, num_stages=1, maxnreg=None)
    # chosen so that every specialisation compiles without spills on sm_80 and sm_90
    # (tests/ops/test_contrastive_loss_aot.py). maxnreg: without a bound ptxas may pick an occupancy-driven
    # register count and spill a few values. fp32 takes smaller tiles and K steps: its "ieee" dot runs on
    # the FMA units with whole operand rows in registers.
    if dtype == torch.float32:
        return LaunchConfig(dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16), num_warps=4, num_stages=2, maxnreg=255)
    return LaunchConfig(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), num_warps=8, num_stages=2, maxnreg=255)


#: The Matryoshka widths the kernels are specialised for: the per-dimension statistics live in (rows, DPAD) tiles.
DIM_PADS = (1, 8)


def dim_pad(ndims: int) -> int:
    """DPAD for ``ndims`` dimensions: 1 (no Matryoshka), 8 for up to 8, else the next power of two (compiled on
    first use, outside the ahead-of-time check)."""
    return 1 if ndims == 1 else max(8, triton.next_power_of_2(ndims))


_TABLES: dict = {}


def device_table(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant table (Matryoshka dims, weights) on ``device``, built once per (values, dtype, device) and
    cached: a per-call ``torch.tensor(list, device=cuda)`` is a host-to-device copy that waits for the GPU. On CUDA
    the values travel from pinned memory without blocking (the caching host allocator keeps the pinned buffer alive
    until the copy is done). The tables stay valid under CUDA-graph capture (built before, by the warm-up call)."""
    device = torch.device(device)
    key = (tuple(values), dtype, device)
    table = _TABLES.get(key)
    if table is None:
        host = torch.tensor(list(values), dtype=dtype)
        table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        if len(_TABLES) > 256:  # a bounded cache: configurations are few, but never let it grow without end
            _TABLES.clear()
        _TABLES[key] = table
    return table


def _launch(x, blocks: dict | None, ndims: int) -> tuple[dict, dict]:
    """(constexprs, launch options) for inputs like ``x``; ``blocks`` overrides tile sizes."""
    cfg = config(x.dtype, interpreting()).with_tiles(**(blocks or {}))
    flags = dict(UPCAST=upcast(x.dtype), DOT_PREC=dot_precision(x.dtype), DPAD=dim_pad(ndims))
    return dict(cfg.tiles, **flags), cfg.options()


class _Operands:
    """The kernel arguments of a problem (the argument list of :func:`stats` / :func:`grads`), with stand-ins for
    the optional ones (never read: their flags are off)."""

    def __init__(self, x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own,
                 a_in, a_own):
        f32 = torch.float32
        self.x = x.contiguous()
        self.rx = rx.to(f32).contiguous()
        self.n, self.d = x.shape
        self.ndims = len(dims)
        self.dims = device_table(dims, torch.int32, x.device)
        self.cols = [c.contiguous() for c in cols]
        self.rcols = [r.to(f32).contiguous() for r in rcols]
        self.sizes = [c.shape[0] for c in self.cols]
        self.has_ids = int(tid is not None)
        dummy_ids = device_table((0,), torch.int64, x.device)  # never read (has_ids = 0)
        self.tid = tid.contiguous() if tid is not None else dummy_ids
        self.ids = [i.contiguous() if i is not None else dummy_ids for i in col_ids]
        self.margin_mode = 0 if thr is None else (2 if gx is not None else 1)
        self.thr = thr.to(f32).contiguous() if thr is not None else self.rx
        self.gx = gx.contiguous() if gx is not None else self.x
        self.gcols = [g.contiguous() if g is not None else self.x for g in gcols]
        self.dg = self.gx.shape[1] if gx is not None else 0
        self.scalars = dict(label_offset=int(label_offset), inv_tau=float(inv_tau), bias_own=float(bias_own),
                            a_in=float(a_in), a_own=float(a_own))

    def segment_args(self):
        """(C0, RC0, C1, RC1) with the second segment standing in for the first when there is none."""
        c1, r1 = (self.cols[1], self.rcols[1]) if len(self.cols) == 2 else (self.cols[0], self.rcols[0])
        return self.cols[0], self.rcols[0], c1, r1

    def common(self):
        """DIMS, TID, IDS0, IDS1, GX, GC0, GC1, THR."""
        ids1 = self.ids[1] if len(self.ids) == 2 else self.ids[0]
        gc1 = self.gcols[1] if len(self.gcols) == 2 else self.gcols[0]
        return self.dims, self.tid, self.ids[0], ids1, self.gx, self.gcols[0], gc1, self.thr

    def sizes_and_strides(self):
        """n_rows, m0, m1, d, dg, ndims, stride_x, stride_c0, stride_c1, stride_gx, stride_gc0, stride_gc1."""
        c0, _, c1, _ = self.segment_args()
        g1 = self.gcols[1] if len(self.gcols) == 2 else self.gcols[0]
        return (self.n, self.sizes[0], self.sizes[1] if len(self.sizes) == 2 else 0, self.d, self.dg, self.ndims,
                self.x.stride(0), c0.stride(0), c1.stride(0), self.gx.stride(0), self.gcols[0].stride(0),
                g1.stride(0))


def stats(x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own, a_in, a_own,
          track_hard, blocks: dict | None = None):
    """(lse, pos, hard, hidx), (len(dims), n) each, fp32 (hidx int64): the problem's statistics (the arguments
    and results of the C++ ``contrastive_cpu_stats``). hard / hidx stay NaN / -1 without ``track_hard``."""
    o = _Operands(x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own, a_in,
                  a_own)
    flags, launch = _launch(o.x, blocks, o.ndims)
    f32 = dict(device=x.device, dtype=torch.float32)
    # poisoned: an entry the kernel does not write stays NaN / -1
    lse, pos, hard = (torch.full((o.ndims, o.n), float("nan"), **f32) for _ in range(3))
    hidx = torch.full((o.ndims, o.n), -1, device=x.device, dtype=torch.int64)
    grid = (triton.cdiv(o.n, flags["BLOCK_M"]),)
    _stats_kernel[grid](o.x, o.rx, *o.segment_args(), *o.common(), lse, pos, hard, hidx, *o.sizes_and_strides(),
                        **o.scalars, track_hard=int(bool(track_hard)), has_ids=o.has_ids, margin_mode=o.margin_mode,
                        NSEG=len(o.cols), **flags, **launch)
    return lse, pos, hard, hidx


def _grad_scale(coefficients, r) -> torch.Tensor:
    """dS is cast to the input dtype for the tensor-core products; a power-of-two scale brings its largest
    coefficient (times the largest prefix-norm ratio r^t / r^last it is multiplied by) to [1, 2), so that fp16
    neither flushes the small softmax terms (~1/(N tau)) to zero nor overflows. Computed on the device (a
    one-element fp32 tensor the kernels load): no host read."""
    cmax = torch.stack([c.abs().amax() for c in coefficients]).amax() * (r / r[-1]).amax()
    scale = torch.exp2(-torch.floor(torch.log2(cmax)))
    return torch.where((cmax > 0) & torch.isfinite(cmax), scale, torch.ones_like(scale)).reshape(1)


def grads(x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own, a_in, a_own,
          L, cce, cdiag, chg, hidx, blocks: dict | None = None):
    """(E_rows (n, d), Q_rows (D, n), E_cols (m, d), Q_cols (D, m)), fp32: the raw-space gradient sums of the C++
    ``contrastive_cpu_grads`` for dS = cce·exp(logit - L) - cdiag·[target] + chg·[hardest], (D, n) each."""
    o = _Operands(x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own, a_in,
                  a_own)
    flags, launch = _launch(o.x, blocks, o.ndims)
    co = [c.to(torch.float32).contiguous() for c in (L, cce, cdiag, chg)] + [hidx.contiguous()]
    coefficients = co[1:4]
    f32 = dict(device=x.device, dtype=torch.float32)
    runtime = dict(o.scalars, has_ids=o.has_ids, margin_mode=o.margin_mode)
    # rows: DA holds Σ_t dS^t (r^t / r^last) unit_t(c); poisoned, each program zeroes and fills its own rows
    scale = _grad_scale(coefficients, o.rx)
    da = torch.full((o.n, o.d), float("nan"), **f32)
    q = torch.full((o.ndims, o.n), float("nan"), **f32)
    _bwd_rows_kernel[(triton.cdiv(o.n, flags["BLOCK_M"]),)](
        o.x, o.rx, *o.segment_args(), *o.common(), *co, da, q, scale, *o.sizes_and_strides(), da.stride(0),
        **runtime, NSEG=len(o.cols), **flags, **launch)
    ex = da.mul_((o.rx[-1] / scale)[:, None])
    ecol = torch.full((sum(o.sizes), o.d), float("nan"), **f32)
    qcols = []
    base = 0
    dims_t, tid, ids0, ids1, gx_, gc0, gc1, thr_ = o.common()
    for seg, (c, rc, m_seg) in enumerate(zip(o.cols, o.rcols, o.sizes)):
        scale = _grad_scale(coefficients, rc)
        db = ecol[base:base + m_seg]
        qc = torch.full((o.ndims, m_seg), float("nan"), **f32)
        gc = (gc0, gc1)[seg]
        _bwd_cols_kernel[(triton.cdiv(m_seg, flags["BLOCK_N"]),)](
            o.x, o.rx, c, rc, dims_t, tid, (ids0, ids1)[seg], gx_, gc, thr_, *co, db, qc, scale, o.n, o.sizes[0],
            m_seg, base, o.d, o.dg, o.ndims, o.x.stride(0), c.stride(0), o.gx.stride(0), gc.stride(0), db.stride(0),
            **runtime, SEG=seg, **flags, **launch)
        db.mul_((rc[-1] / scale)[:, None])
        qcols.append(qc)
        base += m_seg
    return ex, q, ecol, torch.cat(qcols, 1)


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation (kernels/aot.py)

_OPTIONAL = dict(DIMS="*i32", TID="*i64", THR="*fp32")


def _sizes(*names):
    return {n: "i32" for n in names}


def _runtime():
    return dict(label_offset="i32", inv_tau="fp32", bias_own="fp32", a_in="fp32", a_own="fp32")


def _stats_signature(ty):
    sig = {"X": f"*{ty}", "RX": "*fp32", "C0": f"*{ty}", "RC0": "*fp32", "C1": f"*{ty}", "RC1": "*fp32", **_OPTIONAL,
           "IDS0": "*i64", "IDS1": "*i64", "GX": f"*{ty}", "GC0": f"*{ty}", "GC1": f"*{ty}"}
    sig.update({n: "*fp32" for n in ("LSE", "POS", "HARD")}, HIDX="*i64")
    sig.update(_sizes("n_rows", "m0", "m1", "d", "dg", "ndims", "stride_x", "stride_c0", "stride_c1", "stride_gx",
                      "stride_gc0", "stride_gc1"), **_runtime(), **_sizes("track_hard", "has_ids", "margin_mode"))
    return sig


def _coefficient_signature():
    return dict({n: "*fp32" for n in ("L", "CCE", "CDIAG", "CHG")}, HIDX="*i64")


def _bwd_rows_signature(ty):
    sig = {"X": f"*{ty}", "RX": "*fp32", "C0": f"*{ty}", "RC0": "*fp32", "C1": f"*{ty}", "RC1": "*fp32", **_OPTIONAL,
           "IDS0": "*i64", "IDS1": "*i64", "GX": f"*{ty}", "GC0": f"*{ty}", "GC1": f"*{ty}",
           **_coefficient_signature(), "DA": "*fp32", "Q": "*fp32", "SCALE": "*fp32"}
    sig.update(_sizes("n_rows", "m0", "m1", "d", "dg", "ndims", "stride_x", "stride_c0", "stride_c1", "stride_gx",
                      "stride_gc0", "stride_gc1", "stride_da"), **_runtime(), **_sizes("has_ids", "margin_mode"))
    return sig


def _bwd_cols_signature(ty):
    sig = {"X": f"*{ty}", "RX": "*fp32", "C": f"*{ty}", "RC": "*fp32", **_OPTIONAL, "IDS": "*i64",
           "GX": f"*{ty}", "GC": f"*{ty}", **_coefficient_signature(), "DB": "*fp32", "QC": "*fp32", "SCALE": "*fp32"}
    sig.update(_sizes("n_rows", "m0", "m_seg", "base", "d", "dg", "ndims", "stride_x", "stride_c", "stride_gx",
                      "stride_gc", "stride_db"), **_runtime(), **_sizes("has_ids", "margin_mode"))
    return sig


def aot_specs(full: bool = False) -> list[KernelSpec]:
    """Every specialisation the CUDA launchers compile (``full``), or the CI subset.

    ``full``: 3 kernels x dtype (fp16, bf16, fp32 with "ieee" and "tf32" dots) x their constexpr flags (statistics
    and row pass: 1 or 2 column segments; column pass: segment 0 or 1) x DPAD (1: no Matryoshka; 8: up to 8
    Matryoshka dimensions) x row strides divisible by 16 or not (Triton specialises on it: d = 768 vs d = 100).
    Hardest-negative tracking, text ids and the false-negative margin are runtime switches, so every variant
    carries their code. The CI subset keeps the register-heaviest variant of each kernel (both segments / the
    negatives segment, DPAD 8, 16-divisible strides: vectorised loads) for fp16 (bf16 compiles to the same tiles)
    and fp32-ieee.
    """
    dtypes = [(dt, "ieee") for dt in TRITON_TYPE] + [(torch.float32, "tf32")]
    if not full:
        dtypes = [(torch.float16, "ieee"), (torch.float32, "ieee")]
    pads = DIM_PADS if full else (DIM_PADS[-1],)
    segs = (2, 1) if full else (2,)
    kernels = [
        ("stats", _stats_kernel, _stats_signature, [dict(NSEG=s, DPAD=p) for s in segs for p in pads]),
        ("bwd_rows", _bwd_rows_kernel, _bwd_rows_signature, [dict(NSEG=s, DPAD=p) for s in segs for p in pads]),
        ("bwd_cols", _bwd_cols_kernel, _bwd_cols_signature, [dict(SEG=s - 1, DPAD=p) for s in segs for p in pads]),
    ]
    specs = []
    for dt, prec in dtypes:
        ty = TRITON_TYPE[dt]
        cfg = config(dt, interpret=False)
        base, launch = dict(cfg.tiles, UPCAST=False, DOT_PREC=prec), cfg.options()
        for name, fn, signature, variants in kernels:
            for consts in variants:
                for strided in ((True, False) if full else (True,)):
                    sig = signature(ty)
                    tag = "_".join(f"{k.lower()}{int(v)}" for k, v in consts.items())
                    specs.append(KernelSpec(
                        f"cl_{name}_{ty}{'_tf32' if prec == 'tf32' else ''}_{tag}{'' if strided else '_s1'}", fn,
                        sig, dict(base, **consts), divisible_by_16=_aligned(sig, strided), **launch))
    return specs


def _aligned(sig: dict, strides: bool) -> tuple:
    # pointers come from the caching allocator (256-byte aligned); row strides equal d
    return tuple(k for k, v in sig.items() if v.startswith("*") or (strides and k.startswith("stride_")))

"""Triton kernels of the fused cosine InfoNCE + energy-based hinge loss (``fastprompt.ops.contrastive_loss``):
a forward, a backward row pass and a backward column pass, with their launchers and ahead-of-time specs. No
autograd here: ``fastprompt/ops/contrastive.py`` wraps them in a torch.library op. How they work:
``docs/ops/contrastive_loss.md`` ("The Triton kernels in detail").
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from fastprompt.kernels._common import (
    COSINE_EPS,
    TRITON_TYPE,
    LaunchConfig,
    check_device,
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
def _dot_tile(A, B, a0, b0, amask, bmask, d, stride_a, stride_b,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """Raw products A[a0:a0+BLOCK_M] . B[b0:b0+BLOCK_N]^T over the whole d, fp32 accumulation."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = _row_ptrs(A, a0, stride_a, BLOCK_M, BLOCK_K)
    b_ptrs = _row_ptrs(B, b0, stride_b, BLOCK_N, BLOCK_K)
    for k0 in range(0, d, BLOCK_K):
        kmask = (k0 + ks) < d
        a = tl.load(a_ptrs, mask=amask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=bmask[:, None] & kmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _segment(SEG: tl.constexpr, C0, RC0, stride_c0, C1, RC1, stride_c1, bias1):
    """Column segment SEG: (columns, their inverse norms, row stride, bias on each row's own column): z2
    without a bias, then z3 with the hard-negative bias."""
    if SEG == 0:
        return C0, RC0, stride_c0, 0.0
    else:
        return C1, RC1, stride_c1, bias1


@triton.jit
def _cos_tile(X, C, RC, r0, c0, rx, rmask, m_seg, d, stride_x, stride_c,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """Cosines of rows r0.. (inverse norms rx) with the columns c0.. of one segment: (cols, in-bounds mask,
    the columns' inverse norms, the (BLOCK_M x BLOCK_N) cosine tile)."""
    cols = c0 + tl.arange(0, BLOCK_N)
    cmask = cols < m_seg
    acc = _dot_tile(X, C, r0, c0, rmask, cmask, d, stride_x, stride_c, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
    rc = tl.load(RC + cols, mask=cmask, other=0.0)
    return cols, cmask, rc, acc * rx[:, None] * rc[None, :]


@triton.jit
def _block(R, start, n, BLOCK: tl.constexpr):
    """Rows (or columns) start..start+BLOCK: their indices, which are < n, and their inverse norms R."""
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n
    return idx, mask, tl.load(R + idx, mask=mask, other=0.0)


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
def _accumulate_unit(acc_ptrs, amask, w, v_ptrs, vmask, rv, d, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """acc += w @ unit(v) in d-chunks, in the fp32 accumulator rows at ``acc_ptrs``. The unit vectors are the
    raw rows scaled by their inverse norms ``rv`` in fp32, then cast back to the input dtype (so zero rows
    stay zero) for the tensor-core product."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, d, BLOCK_K):
        kmask = (k0 + ks) < d
        v = tl.load(v_ptrs + k0, mask=vmask[:, None] & kmask[None, :], other=0.0)
        v = (v.to(tl.float32) * rv[:, None]).to(v_ptrs.dtype.element_ty)  # unit vectors
        if UPCAST:
            v = v.to(tl.float32)
        omask = amask[:, None] & kmask[None, :]
        old = tl.load(acc_ptrs + k0, mask=omask, other=0.0)
        tl.store(acc_ptrs + k0, tl.dot(w.to(v.dtype), v, old, input_precision=DOT_PREC), mask=omask)


@triton.jit
def _fwd_kernel(X, RX, C0, RC0, C1, RC1, LSE, POS, HARD, HIDX,
                n_rows, m_seg, d, stride_x, stride_c0, stride_c1, pos_offset, inv_tau, bias1,
                NSEG: tl.constexpr, TRACK_HARD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_M
    rows, rmask, rx = _block(RX, r0, n_rows, BLOCK_M)
    pos_col = rows + pos_offset
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    pos_cos = tl.zeros((BLOCK_M,), tl.float32)
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_M,), tl.int32)
    for seg in tl.static_range(NSEG):
        C, RC, stride_c, bias = _segment(seg, C0, RC0, stride_c0, C1, RC1, stride_c1, bias1)
        for c0 in range(0, m_seg, BLOCK_N):
            cols, cmask, rc, cos = _cos_tile(X, C, RC, r0, c0, rx, rmask, m_seg, d, stride_x, stride_c,
                                             BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
            gcol = cols + seg * m_seg
            is_pos = gcol[None, :] == pos_col[:, None]
            pos_cos += tl.sum(tl.where(is_pos, cos, 0.0), axis=1)
            if TRACK_HARD:
                cand = tl.where(cmask[None, :] & ~is_pos, cos, float("-inf"))
                tmax = tl.max(cand, axis=1)
                targ = tl.min(tl.where(cand == tmax[:, None], gcol[None, :], _INT_MAX), axis=1)
                upd = tmax > best  # strict: an equal value in a later tile keeps the lower index
                best = tl.where(upd, tmax, best)
                best_idx = tl.where(upd, targ, best_idx)
            # the bias goes to each row's own column of the segment (SimCSE: the anchor's own hard negative)
            own = cols[None, :] == pos_col[:, None]
            lg = tl.where(cmask[None, :], cos * inv_tau + tl.where(own, bias, 0.0), float("-inf"))
            m_new = tl.maximum(m, tl.max(lg, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(lg - m_new[:, None]), axis=1)
            m = m_new
    tl.store(LSE + rows, m + tl.log(s), mask=rmask)
    tl.store(POS + rows, pos_cos, mask=rmask)
    if TRACK_HARD:
        tl.store(HARD + rows, best, mask=rmask)
        tl.store(HIDX + rows, best_idx.to(tl.int64), mask=rmask)


@triton.jit
def _ds_tile(cos, rows, rmask, cols, cmask, gcol, LSE, CCE, CHG, CDIAG, HIDX, LSE_SYM, CSYM,
             n_rows, pos_offset, inv_tau, bias, SEG: tl.constexpr, SYMMETRIC: tl.constexpr):
    """dLoss/dcos for a tile: softmax part, symmetric part (z2 columns of the positives), one-hot
    terms at the positive (-(ce + hinge + sym) coefficient) and at the hardest negative (+hinge)."""
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    cce = tl.load(CCE + rows, mask=rmask, other=0.0)
    chg = tl.load(CHG + rows, mask=rmask, other=0.0)
    cdiag = tl.load(CDIAG + rows, mask=rmask, other=0.0)
    hidx = tl.load(HIDX + rows, mask=rmask, other=-1).to(tl.int32)
    lg = cos * inv_tau
    own = cols[None, :] == (rows + pos_offset)[:, None]  # the biased column of each row in this segment
    ds = cce[:, None] * tl.exp(lg + tl.where(own, bias, 0.0) - lse[:, None])
    if SYMMETRIC:
        if SEG == 0:
            k = cols - pos_offset
            kmask = cmask & (k >= 0) & (k < n_rows)
            lsym = tl.load(LSE_SYM + k, mask=kmask, other=float("inf"))
            csym = tl.load(CSYM + k, mask=kmask, other=0.0)
            ds += tl.where(kmask[None, :], csym[None, :] * tl.exp(lg - lsym[None, :]), 0.0)
    ds -= tl.where(gcol[None, :] == (rows + pos_offset)[:, None], cdiag[:, None], 0.0)
    ds += tl.where(gcol[None, :] == hidx[:, None], chg[:, None], 0.0)
    return tl.where(rmask[:, None] & cmask[None, :], ds, 0.0)


@triton.jit
def _bwd_rows_kernel(Z1, R1, C0, RC0, C1, RC1, DA, LSE, CCE, CHG, CDIAG, HIDX, LSE_SYM, CSYM,
                     n_rows, m_seg, d, stride_z1, stride_c0, stride_c1, stride_da, pos_offset, inv_tau, bias1,
                     grad_scale,
                     NSEG: tl.constexpr, SYMMETRIC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """DA[rows] = sum_j dS_ij * unit(c_j), accumulated in fp32 in DA (this program's rows only)."""
    r0 = tl.program_id(0) * BLOCK_M
    rows, rmask, rx = _block(R1, r0, n_rows, BLOCK_M)
    da_base = _zeroed_accumulator(DA, r0, rmask, stride_da, d, BLOCK_M, BLOCK_K)
    for seg in tl.static_range(NSEG):
        C, RC, stride_c, bias = _segment(seg, C0, RC0, stride_c0, C1, RC1, stride_c1, bias1)
        for c0 in range(0, m_seg, BLOCK_N):
            cols, cmask, rc, cos = _cos_tile(Z1, C, RC, r0, c0, rx, rmask, m_seg, d, stride_z1, stride_c,
                                             BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
            ds = _ds_tile(cos, rows, rmask, cols, cmask, cols + seg * m_seg, LSE, CCE, CHG, CDIAG, HIDX,
                          LSE_SYM, CSYM, n_rows, pos_offset, inv_tau, bias, seg, SYMMETRIC)
            w = (ds * grad_scale).to(C.dtype.element_ty)
            _accumulate_unit(da_base, rmask, w, _row_ptrs(C, c0, stride_c, BLOCK_N, BLOCK_K), cmask, rc, d, BLOCK_K,
                             UPCAST, DOT_PREC)
            tl.debug_barrier()  # the next tile re-reads what other threads of this program stored


@triton.jit
def _bwd_cols_kernel(Z1, R1, C, RC, DB, LSE, CCE, CHG, CDIAG, HIDX, LSE_SYM, CSYM,
                     n_rows, m_seg, d, stride_z1, stride_c, stride_db, pos_offset, inv_tau, bias, grad_scale,
                     SEG: tl.constexpr, SYMMETRIC: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """DB[cols] = sum_i dS_ij * unit(z1_i) for one segment's column block (this program's columns only)."""
    c0 = tl.program_id(0) * BLOCK_N
    cols, cmask, rc = _block(RC, c0, m_seg, BLOCK_N)
    db_base = _zeroed_accumulator(DB, c0, cmask, stride_db, d, BLOCK_N, BLOCK_K)
    for r0 in range(0, n_rows, BLOCK_M):
        rows, rmask, rx = _block(R1, r0, n_rows, BLOCK_M)
        acc = _dot_tile(Z1, C, r0, c0, rmask, cmask, d, stride_z1, stride_c,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PREC)
        cos = acc * rx[:, None] * rc[None, :]
        ds = _ds_tile(cos, rows, rmask, cols, cmask, cols + SEG * m_seg, LSE, CCE, CHG, CDIAG, HIDX,
                      LSE_SYM, CSYM, n_rows, pos_offset, inv_tau, bias, SEG, SYMMETRIC)
        w = tl.trans((ds * grad_scale).to(Z1.dtype.element_ty))  # (cols, rows)
        _accumulate_unit(db_base, cmask, w, _row_ptrs(Z1, r0, stride_z1, BLOCK_M, BLOCK_K), rmask, rx, d, BLOCK_K,
                         UPCAST, DOT_PREC)
        tl.debug_barrier()


# ------------------------------------------------------------------------------------------------
# host side


check_interpreted(_fwd_kernel, _bwd_rows_kernel, _bwd_cols_kernel)


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


def _launch(z1, blocks: dict | None) -> tuple[dict, dict]:
    """(constexprs, launch options) for inputs like ``z1``; ``blocks`` overrides tile sizes."""
    check_device(z1)
    cfg = config(z1.dtype, interpreting()).with_tiles(**(blocks or {}))
    flags = dict(UPCAST=upcast(z1.dtype), DOT_PREC=dot_precision(z1.dtype))
    return dict(cfg.tiles, **flags), cfg.options()


def _operands(z1, z2, z3):
    """Contiguous z1, z2, z3, the second column segment (z3, or z2 again when there is none: the kernels take
    two segment pointers) and the inverse row norms r1, r2, r3 (r3 = r2 without z3)."""
    z1, z2 = z1.contiguous(), z2.contiguous()
    z3 = None if z3 is None else z3.contiguous()
    r1, r2 = inv_norms(z1), inv_norms(z2)
    return z1, z2, z3, (z3 if z3 is not None else z2), r1, r2, (inv_norms(z3) if z3 is not None else r2)


def inv_norms(z: torch.Tensor) -> torch.Tensor:
    """1 / max(||z_i||, eps) in fp32 (no fp32 copy of z)."""
    return torch.linalg.vector_norm(z, dim=1, dtype=torch.float32).clamp_min_(COSINE_EPS).reciprocal_()


def forward(z1, z2, z3, temperature, hard_negative_weight, hinge_margin, hinge_weight, symmetric,
            positive_offset, track_hard: bool = True, blocks: dict | None = None):
    """(row_loss, lse, lse_sym, pos_sim, hard_sim, hard_idx), all fp32 (hard_idx int64). Without
    ``track_hard`` (only allowed when hinge_weight == 0) hard_sim / hard_idx stay NaN / -1."""
    if hinge_weight != 0.0 and not track_hard:
        raise ValueError("the hinge needs the hardest negative: track_hard must be True when hinge_weight != 0")
    flags, launch = _launch(z1, blocks)
    z1, z2, z3, c1, r1, r2, r3 = _operands(z1, z2, z3)
    n, d = z1.shape
    m2 = z2.shape[0]
    f32 = dict(device=z1.device, dtype=torch.float32)
    # poisoned: a row the kernel does not write stays NaN
    lse, pos = torch.full((n,), float("nan"), **f32), torch.full((n,), float("nan"), **f32)
    hard = torch.full((n,), float("nan"), **f32)
    hidx = torch.full((n,), -1, device=z1.device, dtype=torch.int64)
    inv_tau = 1.0 / temperature
    grid = (triton.cdiv(n, flags["BLOCK_M"]),)
    _fwd_kernel[grid](z1, r1, z2, r2, c1, r3, lse, pos, hard, hidx, n, m2, d, z1.stride(0), z2.stride(0),
                      c1.stride(0), positive_offset, inv_tau, float(hard_negative_weight),
                      NSEG=2 if z3 is not None else 1, TRACK_HARD=bool(track_hard), **flags, **launch)
    lse_sym = torch.full((n if symmetric else 0,), float("nan"), **f32)
    if symmetric:
        p = z2[positive_offset:positive_offset + n]
        unused = torch.empty((n,), **f32)
        _fwd_kernel[grid](p, r2[positive_offset:positive_offset + n], z1, r1, z1, r1, lse_sym, unused, unused,
                          hidx, n, n, d, p.stride(0), z1.stride(0), z1.stride(0), 0, inv_tau, 0.0,
                          NSEG=1, TRACK_HARD=False, **flags, **launch)
    loss = lse - pos * inv_tau
    if symmetric:
        loss = 0.5 * (loss + lse_sym - pos * inv_tau)
    if hinge_weight != 0.0:
        loss = loss + hinge_weight * (hinge_margin + hard - pos).clamp_min(0)
    return loss, lse, lse_sym, pos, hard, hidx


def _normalize_backward(da: torch.Tensor, z: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. z from the gradient w.r.t. z / max(||z||, eps): r·dA - r³ (z·dA) z."""
    zf = z.float()
    proj = (zf * da).sum(1) * r.pow(3) * (r < 1.0 / COSINE_EPS)
    return (da * r[:, None] - zf * proj[:, None]).to(z.dtype)


def backward(grad, z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx, temperature, hard_negative_weight,
             hinge_margin, hinge_weight, symmetric, positive_offset, blocks: dict | None = None):
    """(dz1, dz2, dz3 or None) for the per-row upstream gradient ``grad``."""
    flags, launch = _launch(z1, blocks)
    z1, z2, z3, c1, r1, r2, r3 = _operands(z1, z2, z3)
    n, d = z1.shape
    m2 = z2.shape[0]
    inv_tau = 1.0 / temperature
    g = grad.float().contiguous()
    # per-row coefficients of dS (see _ds_tile)
    cce = g * ((0.5 if symmetric else 1.0) * inv_tau)
    chg = g * hinge_weight * (hinge_margin + hard_sim - pos_sim > 0) if hinge_weight != 0.0 else torch.zeros_like(g)
    csym = cce if symmetric else torch.zeros_like(g)
    cdiag = cce + chg + csym
    lse_sym_ = lse_sym if symmetric else torch.zeros_like(g)
    # dS is cast to the input dtype for the tensor-core products; a power-of-two scale brings its largest
    # coefficient to [1, 2) so that fp16 does not flush the small softmax terms (~1/(N tau)) to zero
    cmax = float(torch.stack([cce.abs().max(), chg.abs().max(), csym.abs().max()]).max())
    grad_scale = 2.0 ** -math.floor(math.log2(cmax)) if cmax > 0 else 1.0
    f32 = dict(device=z1.device, dtype=torch.float32)
    da = torch.full((n, d), float("nan"), **f32)  # poisoned: the kernel zeroes and fills its own rows
    nseg = 2 if z3 is not None else 1
    common = (lse, cce, chg, cdiag, hard_idx, lse_sym_, csym)
    _bwd_rows_kernel[(triton.cdiv(n, flags["BLOCK_M"]),)](
        z1, r1, z2, r2, c1, r3, da, *common, n, m2, d, z1.stride(0), z2.stride(0), c1.stride(0), da.stride(0),
        positive_offset, inv_tau, float(hard_negative_weight), grad_scale, NSEG=nseg, SYMMETRIC=bool(symmetric),
        **flags, **launch)
    dcols = []
    for seg, (c, rc, bias) in enumerate([(z2, r2, 0.0), (z3, r3, float(hard_negative_weight))][:nseg]):
        db = torch.full((m2, d), float("nan"), **f32)
        _bwd_cols_kernel[(triton.cdiv(m2, flags["BLOCK_N"]),)](
            z1, r1, c, rc, db, *common, n, m2, d, z1.stride(0), c.stride(0), db.stride(0), positive_offset,
            inv_tau, bias, grad_scale, SEG=seg, SYMMETRIC=bool(symmetric), **flags, **launch)
        dcols.append(_normalize_backward(db.mul_(1.0 / grad_scale), c, rc))
    return _normalize_backward(da.mul_(1.0 / grad_scale), z1, r1), dcols[0], (dcols[1] if nseg == 2 else None)


# ------------------------------------------------------------------------------------------------
# ahead-of-time compilation (kernels/aot.py)


def _fwd_signature(ty):
    sig = {n: f"*{ty}" for n in ("X", "C0", "C1")}
    sig.update({n: "*fp32" for n in ("RX", "RC0", "RC1", "LSE", "POS", "HARD")})
    sig.update(HIDX="*i64", n_rows="i32", m_seg="i32", d="i32", stride_x="i32", stride_c0="i32", stride_c1="i32",
               pos_offset="i32", inv_tau="fp32", bias1="fp32")
    return sig


def _coef_signature():
    sig = {n: "*fp32" for n in ("LSE", "CCE", "CHG", "CDIAG", "LSE_SYM", "CSYM")}
    sig["HIDX"] = "*i64"
    return sig


def _bwd_rows_signature(ty):
    sig = {n: f"*{ty}" for n in ("Z1", "C0", "C1")}
    sig.update({n: "*fp32" for n in ("R1", "RC0", "RC1", "DA")}, **_coef_signature())
    sig.update(n_rows="i32", m_seg="i32", d="i32", stride_z1="i32", stride_c0="i32", stride_c1="i32",
               stride_da="i32", pos_offset="i32", inv_tau="fp32", bias1="fp32", grad_scale="fp32")
    return sig


def _bwd_cols_signature(ty):
    sig = {n: f"*{ty}" for n in ("Z1", "C")}
    sig.update({n: "*fp32" for n in ("R1", "RC", "DB")}, **_coef_signature())
    sig.update(n_rows="i32", m_seg="i32", d="i32", stride_z1="i32", stride_c="i32", stride_db="i32",
               pos_offset="i32", inv_tau="fp32", bias="fp32", grad_scale="fp32")
    return sig


def aot_specs(full: bool = False) -> list[KernelSpec]:
    """Every specialisation the CUDA launchers compile (``full``), or the CI subset.

    ``full``: 3 kernels x dtype (fp16, bf16, fp32 with "ieee" and "tf32" dots) x their flags (forward:
    1 or 2 column segments x hardest-negative tracking on/off; row pass: segments x symmetric; column
    pass: segment 0/1 x symmetric) x row strides divisible by 16 or not (Triton specialises on it: d = 768
    vs d = 100). The CI subset keeps the register-heaviest variant of each kernel (both segments / the z2
    segment, hardest tracking, symmetric, 16-divisible strides: vectorised loads) for fp16 (bf16
    compiles to the same tiles) and fp32-ieee.
    """
    dtypes = [(dt, "ieee") for dt in TRITON_TYPE] + [(torch.float32, "tf32")]
    if not full:
        dtypes = [(torch.float16, "ieee"), (torch.float32, "ieee")]
    flags = [(2, True), (2, False), (1, True), (1, False)] if full else [(2, True)]
    kernels = [
        ("fwd", _fwd_kernel, _fwd_signature, [dict(NSEG=a, TRACK_HARD=b) for a, b in flags]),
        ("bwd_rows", _bwd_rows_kernel, _bwd_rows_signature, [dict(NSEG=a, SYMMETRIC=b) for a, b in flags]),
        ("bwd_cols", _bwd_cols_kernel, _bwd_cols_signature, [dict(SEG=2 - a, SYMMETRIC=b) for a, b in flags]),
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

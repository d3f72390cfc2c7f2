"""Triton kernels of the fused prefix attention (``fastprompt.ops.prefix_attention``): a forward and three
backward kernels that attend to ``[prefix ; tokens]`` without materialising the concatenation, with their
launchers and ahead-of-time specs. No autograd here: ``fastprompt/ops/attention.py`` wraps them. How they
work: ``docs/ops/prefix_attention.md`` ("The Triton kernels in detail").
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from fastprompt.kernels._common import (
    LN2,
    LOG2E,
    TRITON_TYPE,
    LaunchConfig,
    check_interpreted,
    dot_precision,
    interpreting,
    upcast,
)
from fastprompt.kernels.aot import KernelSpec

#: What the launchers pass as a window bound for "unbounded" (-1 in the API): beyond any row offset, and small
#: enough that ``row + bound`` stays an int32.
UNBOUNDED = 1 << 30

# ------------------------------------------------------------------------------------------------
# device helpers
#
# One kernel serves both layouts. An example b ("sequence" when packed) is ``seqlen`` rows starting at row
# ``start`` of its batch slice: padded batches pass CU = [0, S] with stride_cu = 0 (every example: rows 0..S of
# slice b), packed ones pass cu_seqlens with stride_cu = 1 and zero batch strides (every sequence: its rows of
# the one (1, H, N, D) slice). S is the padded length, or max_seqlen when packed: the dropout counter's row
# length and the attention bias' side. Token positions (causal/window masks, bias, dropout) count from start.


@triton.jit
def _keep(seed_lo, seed_hi, bh, rows, cols, n_cols, dropout_p):
    """Dropout keep-mask at (rows x cols) of the virtual concatenation (rows/cols broadcast): element
    e = rows * n_cols + cols (mod 2^32) reads word e % 4 of Philox at counter (e // 4, bh, seed_hi, 0), as the C++
    kernel does (csrc/philox.h), which draws one Philox call per four elements."""
    e = (rows * n_cols + cols).to(tl.uint32)
    c0 = e >> 2
    c1 = (c0 * 0 + bh).to(tl.uint32)
    c2 = (c0 * 0 + seed_hi).to(tl.uint32)
    c3 = c0 * 0
    r0, r1, r2, r3 = tl.philox(seed_lo, c0, c1, c2, c3)
    word = e & 3
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _seq(CU, stride_cu, b, S):
    """Example b's first row in its batch slice and its number of rows (a packed sequence longer than S =
    max_seqlen is cut to S; the host checks that there is none)."""
    start = tl.load(CU + b * stride_cu)
    return start, tl.minimum(tl.load(CU + b * stride_cu + 1) - start, S)


@triton.jit
def _program_rows(CU, stride_cu, H, S, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program of the grid (cdiv(S, BLOCK_M), B*H): its bh = b*H + h, b, h, the example's start and length,
    its first row, the row and head-dim offsets and their bounds."""
    bh = tl.program_id(1)
    b = bh // H
    start, seqlen = _seq(CU, stride_cu, b, S)
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return bh, b, bh % H, start, seqlen, m0, offs_m, offs_d, offs_d < D, offs_m < seqlen


@triton.jit
def _span(first, last, n, before, after, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """[lo, hi): the positions x with first - before <= x <= last + after among 0..n, lo rounded down to a
    multiple of BLOCK; all n positions unless MASKED. The token tiles that rows first..last may see (before,
    after = win_left, win_right), or the row tiles that may see keys first..last (win_right, win_left)."""
    if MASKED:
        lo = tl.maximum(first - before, 0) // BLOCK * BLOCK
        hi = tl.minimum(last + after + 1, n)
    else:
        lo = 0
        hi = n
    return lo, hi


@triton.jit
def _in_window(rows, cols, win_left, win_right):
    """Token col is visible to row (broadcast): row - win_left <= col <= row + win_right (causal: win_right = 0)."""
    d = cols - rows
    return (d <= win_right) & (d >= -win_left)


@triton.jit
def _bias(BIAS, rows, cols, ok, stride_m):
    """The additive bias of one example and head at (rows x cols) (broadcast), in base-2 units; 0 where not ok."""
    return tl.load(BIAS + rows * stride_m + cols, mask=ok, other=0.0).to(tl.float32) * LOG2E


@triton.jit
def _load_rows(X, offs, offs_d, mask, stride_row, UPCAST: tl.constexpr):
    """(rows x BLOCK_D) tile of X at row offsets ``offs`` (unit last stride); zeros where masked."""
    x = tl.load(X + offs[:, None] * stride_row + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _prefix_kv(PK, PV, PIDX, stride_pidx, stride_pkt, stride_pkh, stride_pvt, stride_pvh, b, kvh):
    """Base pointers of example b's prompt (its ``prompt_index`` row) at key/value head kvh."""
    t = tl.load(PIDX + b * stride_pidx)
    return PK + t * stride_pkt + kvh * stride_pkh, PV + t * stride_pvt + kvh * stride_pvh


@triton.jit
def _token_keys(MASK, stride_mb, b, n0, seqlen, BLOCK_N: tl.constexpr):
    """Token key rows n0..n0+BLOCK_N of example b: offsets, in the sequence, and visible (not padding)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seqlen
    return offs_n, n_ok, n_ok & (tl.load(MASK + b * stride_mb + offs_n, mask=n_ok, other=0) != 0)


@triton.jit
def _kv_scores(q, kv_k, kv_v, offs_n, offs_d, d_ok, valid, stride_k, stride_v, qk_scale,
               UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key/value tile (rows ``offs_n``, zeros where not ``valid``) and the base-2 scores q k^T * qk_scale."""
    ld = valid[:, None] & d_ok[None, :]
    k = _load_rows(kv_k, offs_n, offs_d, ld, stride_k, UPCAST)
    v = _load_rows(kv_v, offs_n, offs_d, ld, stride_v, UPCAST)
    return k, v, tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale


@triton.jit
def _token_tile(q, kb, vb, biasb, offs_m, m_ok, offs_n, n_vis, offs_d, d_ok, stride_k, stride_v, stride_biasm,
                qk_scale, win_left, win_right,
                UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """k, v, the base-2 scores with the bias added, and the (rows x keys) visibility of one token key tile."""
    k, v, s = _kv_scores(q, kb, vb, offs_n, offs_d, d_ok, n_vis, stride_k, stride_v, qk_scale, UPCAST, DOT_PREC)
    vis = n_vis[None, :]
    if MASKED:
        vis = vis & _in_window(offs_m[:, None], offs_n[None, :], win_left, win_right)
    if HAS_BIAS:
        s += _bias(biasb, offs_m[:, None], offs_n[None, :], m_ok[:, None] & n_vis[None, :], stride_biasm)
    return k, v, s, vis


@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, vis, cols, offs_m, n_cols, dropout_p, seed_lo, seed_hi, bh,
                  DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr):
    """The online-softmax update of the forward with one key tile (scores s, visibility vis)."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(seed_lo, seed_hi, bh, offs_m[:, None], cols[None, :], n_cols, dropout_p), p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# ------------------------------------------------------------------------------------------------
# forward


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stride_cu", "group", "win_left", "win_right"])
def _fwd_kernel(
    Q, K, V, PK, PV, PIDX, MASK, CU, BIAS, O, LSE,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_pkt, stride_pkh, stride_pkp, stride_pvt, stride_pvh, stride_pvp,
    stride_pidx, stride_mb, stride_cu, stride_biasb, stride_biash, stride_biasm,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    H, S, P, D, group, win_left, win_right, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh, b, h, start, seqlen, m0, offs_m, offs_d, d_ok, m_ok = _program_rows(CU, stride_cu, H, S, D, BLOCK_M, BLOCK_D)
    if m0 >= seqlen:  # a packed sequence shorter than max_seqlen
        return
    kvh = h // group
    q = _load_rows(Q + b * stride_qb + h * stride_qh + start * stride_qs, offs_m, offs_d,
                   m_ok[:, None] & d_ok[None, :], stride_qs, UPCAST)
    qk_scale = sm_scale * LOG2E
    n_cols = P + S
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    pk, pv = _prefix_kv(PK, PV, PIDX, stride_pidx, stride_pkt, stride_pkh, stride_pvt, stride_pvh, b, kvh)
    for n0 in range(0, P, BLOCK_P):  # the prefix: always visible
        offs_n = n0 + tl.arange(0, BLOCK_P)
        ok = offs_n < P
        _, v, s = _kv_scores(q, pk, pv, offs_n, offs_d, d_ok, ok, stride_pkp, stride_pvp, qk_scale, UPCAST, DOT_PREC)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, ok[None, :], offs_n, offs_m, n_cols, dropout_p,
                                      seed_lo, seed_hi, bh, DROPOUT, DOT_PREC)
    kb = K + b * stride_kb + kvh * stride_kh + start * stride_ks
    vb = V + b * stride_vb + kvh * stride_vh + start * stride_vs
    biasb = BIAS + b * stride_biasb + h * stride_biash
    lo, hi = _span(m0, tl.minimum(m0 + BLOCK_M, seqlen) - 1, seqlen, win_left, win_right, BLOCK_N, MASKED)
    for n0 in range(lo, hi, BLOCK_N):  # the token tiles these rows can see
        offs_n, _, n_vis = _token_keys(MASK, stride_mb, b, n0, seqlen, BLOCK_N)
        _, v, s, vis = _token_tile(q, kb, vb, biasb, offs_m, m_ok, offs_n, n_vis, offs_d, d_ok, stride_ks, stride_vs,
                                   stride_biasm, qk_scale, win_left, win_right, UPCAST, DOT_PREC, MASKED, HAS_BIAS)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, vis, P + offs_n, offs_m, n_cols, dropout_p,
                                      seed_lo, seed_hi, bh, DROPOUT, DOT_PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(l_i == 0.0, float("-inf"), m_i * LN2 + tl.log(l_safe))
    tl.store(O + b * stride_ob + h * stride_oh + (start + offs_m[:, None]) * stride_os + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + b * stride_lb + h * stride_lh + start + offs_m, lse, mask=m_ok)


# ------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _dq_step(dq, s, k, v, vis, do, lse2, delta, cols, offs_m, n_cols, dropout_p, seed_lo, seed_hi, bh,
             DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr):
    """dQ += dS K for one key tile; also returns dS (the gradient of the scaled scores, natural units)."""
    p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    if DROPOUT:
        keep = _keep(seed_lo, seed_hi, bh, offs_m[:, None], cols[None, :], n_cols, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC), ds


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stride_cu", "group", "win_left", "win_right"])
def _bwd_dq_kernel(
    Q, K, V, PK, PV, PIDX, MASK, CU, BIAS, O, DO, LSE, DELTA, DQ, DBIAS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_pkt, stride_pkh, stride_pkp, stride_pvt, stride_pvh, stride_pvp,
    stride_pidx, stride_mb, stride_cu, stride_biasb, stride_biash, stride_biasm,
    stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs, stride_lb, stride_lh, stride_dbb, stride_dbh, stride_dbm,
    H, S, P, D, group, win_left, win_right, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh, b, h, start, seqlen, m0, offs_m, offs_d, d_ok, m_ok = _program_rows(CU, stride_cu, H, S, D, BLOCK_M, BLOCK_D)
    if m0 >= seqlen:
        return
    kvh = h // group
    md = m_ok[:, None] & d_ok[None, :]
    q = _load_rows(Q + b * stride_qb + h * stride_qh + start * stride_qs, offs_m, offs_d, md, stride_qs, False)
    do = _load_rows(DO + b * stride_dob + h * stride_doh + start * stride_dos, offs_m, offs_d, md, stride_dos, False)
    o = _load_rows(O + b * stride_ob + h * stride_oh + start * stride_os, offs_m, offs_d, md, stride_os, False)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    row_stats = b * stride_lb + h * stride_lh + start + offs_m
    tl.store(DELTA + row_stats, delta, mask=m_ok)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + row_stats, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # empty rows: p = 0
    qk_scale = sm_scale * LOG2E
    n_cols = P + S
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    pk, pv = _prefix_kv(PK, PV, PIDX, stride_pidx, stride_pkt, stride_pkh, stride_pvt, stride_pvh, b, kvh)
    for n0 in range(0, P, BLOCK_P):
        offs_n = n0 + tl.arange(0, BLOCK_P)
        ok = offs_n < P
        k, v, s = _kv_scores(q, pk, pv, offs_n, offs_d, d_ok, ok, stride_pkp, stride_pvp, qk_scale, UPCAST, DOT_PREC)
        dq, _ = _dq_step(dq, s, k, v, ok[None, :], do, lse2, delta, offs_n, offs_m, n_cols, dropout_p,
                         seed_lo, seed_hi, bh, DROPOUT, DOT_PREC)
    kb = K + b * stride_kb + kvh * stride_kh + start * stride_ks
    vb = V + b * stride_vb + kvh * stride_vh + start * stride_vs
    biasb = BIAS + b * stride_biasb + h * stride_biash
    lo, hi = _span(m0, tl.minimum(m0 + BLOCK_M, seqlen) - 1, seqlen, win_left, win_right, BLOCK_N, MASKED)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n, n_ok, n_vis = _token_keys(MASK, stride_mb, b, n0, seqlen, BLOCK_N)
        k, v, s, vis = _token_tile(q, kb, vb, biasb, offs_m, m_ok, offs_n, n_vis, offs_d, d_ok, stride_ks, stride_vs,
                                   stride_biasm, qk_scale, win_left, win_right, UPCAST, DOT_PREC, MASKED, HAS_BIAS)
        dq, ds = _dq_step(dq, s, k, v, vis, do, lse2, delta, P + offs_n, offs_m, n_cols, dropout_p,
                          seed_lo, seed_hi, bh, DROPOUT, DOT_PREC)
        if BIAS_GRAD:  # dS is the bias gradient; tiles no row sees stay as the host zeroed them
            tl.store(DBIAS + b * stride_dbb + h * stride_dbh + offs_m[:, None] * stride_dbm + offs_n[None, :], ds,
                     mask=m_ok[:, None] & n_ok[None, :])
    tl.store(DQ + b * stride_dqb + h * stride_dqh + (start + offs_m[:, None]) * stride_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=md)


@triton.jit
def _kv_tile_grads(dk, dv, k, v, n_vis, offs_n, cols, qb, dob, lseb, deltab, biasb, bh, lo, hi, seqlen, offs_d, d_ok,
                   stride_qs, stride_dos, stride_biasm, qk_scale, n_cols, win_left, win_right, dropout_p, seed_lo,
                   seed_hi, DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                   MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Accumulate dK, dV of one key/value tile (key rows offs_n, visible where n_vis; dropout columns cols) over
    query rows lo..hi of one example and query head (pointers qb, dob, lseb, deltab, biasb at its first row),
    in transposed form (keys x queries)."""
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < seqlen
        md = m_ok[:, None] & d_ok[None, :]
        q = _load_rows(qb, offs_m, offs_d, md, stride_qs, UPCAST)
        do = _load_rows(dob, offs_m, offs_d, md, stride_dos, UPCAST)
        lse = tl.load(lseb + offs_m, mask=m_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(deltab + offs_m, mask=m_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (keys, queries)
        vis = n_vis[:, None]
        if MASKED:
            vis = vis & _in_window(offs_m[None, :], offs_n[:, None], win_left, win_right)
        if HAS_BIAS:
            s_t += _bias(biasb, offs_m[None, :], offs_n[:, None], n_vis[:, None] & m_ok[None, :], stride_biasm)
        p_t = tl.where(vis, tl.exp2(s_t - lse2[None, :]), 0.0)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        if DROPOUT:
            keep = _keep(seed_lo, seed_hi, bh, offs_m[None, :], cols[:, None], n_cols, dropout_p)
            inv = 1.0 / (1.0 - dropout_p)
            pd_t = tl.where(keep, p_t * inv, 0.0)
            dp_t = tl.where(keep, dp_t * inv, 0.0)
        else:
            pd_t = p_t
        dv += tl.dot(pd_t.to(do.dtype), do, input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stride_cu", "group", "win_left", "win_right"])
def _bwd_dkdv_kernel(
    Q, K, V, MASK, CU, BIAS, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_mb, stride_cu, stride_biasb, stride_biash, stride_biasm, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs, stride_lb, stride_lh,
    H, S, P, D, group, win_left, win_right, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid (cdiv(S, BLOCK_N), B * Hkv): a program owns one token key tile of one key/value head and sums over
    # the group of query heads that read it (in order: deterministic, no atomics)
    n_kv_heads = H // group
    b = tl.program_id(1) // n_kv_heads
    kvh = tl.program_id(1) % n_kv_heads
    start, seqlen = _seq(CU, stride_cu, b, S)
    n0 = tl.program_id(0) * BLOCK_N
    if n0 >= seqlen:
        return
    offs_n, n_ok, n_vis = _token_keys(MASK, stride_mb, b, n0, seqlen, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    nd = n_ok[:, None] & d_ok[None, :]
    k = _load_rows(K + b * stride_kb + kvh * stride_kh + start * stride_ks, offs_n, offs_d, nd, stride_ks, UPCAST)
    v = _load_rows(V + b * stride_vb + kvh * stride_vh + start * stride_vs, offs_n, offs_d, nd, stride_vs, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, hi = _span(n0, tl.minimum(n0 + BLOCK_N, seqlen) - 1, seqlen, win_right, win_left, BLOCK_M, MASKED)
    for g in range(0, group):
        h = kvh * group + g
        stats = b * stride_lb + h * stride_lh + start
        dk, dv = _kv_tile_grads(dk, dv, k, v, n_vis, offs_n, P + offs_n,
                                Q + b * stride_qb + h * stride_qh + start * stride_qs,
                                DO + b * stride_dob + h * stride_doh + start * stride_dos, LSE + stats, DELTA + stats,
                                BIAS + b * stride_biasb + h * stride_biash, b * H + h, lo, hi, seqlen, offs_d, d_ok,
                                stride_qs, stride_dos, stride_biasm, sm_scale * LOG2E, P + S, win_left, win_right,
                                dropout_p, seed_lo, seed_hi, DROPOUT, UPCAST, DOT_PREC, MASKED, HAS_BIAS, BLOCK_M)
    tl.store(DK + b * stride_dkb + kvh * stride_dkh + (start + offs_n[:, None]) * stride_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=nd)
    tl.store(DV + b * stride_dvb + kvh * stride_dvh + (start + offs_n[:, None]) * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=nd)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stride_cu", "group"])
def _bwd_prefix_kernel(
    Q, PK, PV, ORDER, SEG, CU, DO, LSE, DELTA, DPK, DPV,
    stride_qb, stride_qh, stride_qs, stride_pkt, stride_pkh, stride_pkp, stride_pvt, stride_pvh, stride_pvp,
    stride_cu, stride_dob, stride_doh, stride_dos, stride_lb, stride_lh,
    H, S, P, D, T, group, batch_chunk, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # ORDER lists the examples grouped by prompt (stable), SEG[t]:SEG[t+1] is prompt t's segment of it.
    # Program (t, kvh, prefix tile) x c walks the part of t's segment that lies in the c-th batch chunk, and
    # every query head of kvh's group for each of those examples (the prefix is visible to every row).
    n_pblocks = tl.cdiv(P, BLOCK_P)
    n_kv_heads = H // group
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    t = pid // (n_kv_heads * n_pblocks)
    kvh = (pid // n_pblocks) % n_kv_heads
    offs_n = (pid % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n_ok = offs_n < P
    nd = n_ok[:, None] & d_ok[None, :]
    k = _load_rows(PK + t * stride_pkt + kvh * stride_pkh, offs_n, offs_d, nd, stride_pkp, UPCAST)
    v = _load_rows(PV + t * stride_pvt + kvh * stride_pvh, offs_n, offs_d, nd, stride_pvp, UPCAST)
    dk = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    lo = tl.maximum(tl.load(SEG + t), chunk * batch_chunk)
    hi = tl.minimum(tl.load(SEG + t + 1), (chunk + 1) * batch_chunk)
    for j in range(lo, hi):
        b = tl.load(ORDER + j)
        start, seqlen = _seq(CU, stride_cu, b, S)
        for g in range(0, group):
            h = kvh * group + g
            stats = b * stride_lb + h * stride_lh + start
            dk, dv = _kv_tile_grads(dk, dv, k, v, n_ok, offs_n, offs_n,
                                    Q + b * stride_qb + h * stride_qh + start * stride_qs,
                                    DO + b * stride_dob + h * stride_doh + start * stride_dos, LSE + stats,
                                    DELTA + stats, Q, b * H + h, 0, seqlen, seqlen, offs_d, d_ok, stride_qs,
                                    stride_dos, 0, sm_scale * LOG2E, P + S, 0, 0, dropout_p, seed_lo, seed_hi,
                                    DROPOUT, UPCAST, DOT_PREC, False, False, BLOCK_M)
    out = (((chunk * T + t) * n_kv_heads + kvh) * P + offs_n[:, None]) * D + offs_d[None, :]  # (C, T, Hkv, P, D)
    tl.store(DPK + out, dk * sm_scale, mask=nd)
    tl.store(DPV + out, dv, mask=nd)


# ------------------------------------------------------------------------------------------------
# configuration (shared by the launchers and the ahead-of-time check, so both see the same specialisations)

KERNELS = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_prefix")
# the tile constexprs each kernel takes (BLOCK_M: query rows, BLOCK_N: token key rows, BLOCK_P: prefix key
# rows, BLOCK_D: the head dim padded to a power of two)
_TILES = {"fwd": ("BLOCK_M", "BLOCK_N", "BLOCK_P", "BLOCK_D"),
          "bwd_dq": ("BLOCK_M", "BLOCK_N", "BLOCK_P", "BLOCK_D"),
          "bwd_dkdv": ("BLOCK_M", "BLOCK_N", "BLOCK_D"),
          "bwd_prefix": ("BLOCK_M", "BLOCK_P", "BLOCK_D")}


def config(kernel: str, S: int, P: int, D: int, dtype: torch.dtype, dropout: bool, switches: bool = False,
           tf32: bool = False) -> LaunchConfig:
    """The tiles each kernel is launched with (chosen, with ``LaunchConfig.maxnreg``, so that no specialisation
    spills on sm_80/sm_90: see ``aot_specs`` and the AOT test). Short sequences (S <= 32, BERT-style
    sentences) get 32-row tiles. ``switches``: a token window or an attention bias is on (more live registers);
    ``tf32``: fp32 inputs multiplied on TF32 tensor cores."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    bd = max(32, triton.next_power_of_2(D))
    warps = 8 if bd == 128 else 4

    def launch(M, N, Pt, num_warps, num_stages=2, maxnreg=255):
        tiles = dict(BLOCK_M=M, BLOCK_N=N, BLOCK_P=Pt, BLOCK_D=bd)
        return LaunchConfig({k: tiles[k] for k in _TILES[kernel]}, num_warps, num_stages, maxnreg)

    if dtype == torch.float32:
        # Exact fp32 dots run on FMA units with whole operand rows in registers: 16-row tiles (32-row tiles
        # spill at D = 128, and erratically at D = 64). ptxas is erratic here (measured per specialisation by the
        # AOT check): at D = 128 with 4 warps it spills under its own occupancy heuristic and under a
        # 255-register bound alike, depending on the switches, so D = 128 runs 8 warps: exact products with a
        # 128-register bound and the row loops of dK/dV and the prefix gradients not software-pipelined (which
        # is what made them spill), TF32 products (tensor cores) with the 255 bound (its heuristic spills a few).
        # Below D = 128 the prefix-gradient kernel is not pipelined either (it spills at D = 64 with dropout).
        row_loop = kernel == "bwd_prefix" or (kernel == "bwd_dkdv" and bd == 128 and not tf32)
        return launch(16, 16, 16, 8 if bd == 128 else 4, num_stages=1 if row_loop else 2,
                      maxnreg=128 if bd == 128 and not tf32 else 255)
    big = 32 if S <= 32 else 64
    bp = 16 if P <= 16 else 32
    if kernel == "fwd":  # a window or bias tile on top of 64 x 128 rows spills with 4 warps
        bn = 32 if dropout else big
        return launch(big, bn, 16 if P <= 16 else bn, 8 if switches and bd == 128 else 4)
    if kernel == "bwd_dq":  # likewise at 64 x 64; at 64 x 128 even 8 warps spill (the bias gradient tile is live)
        return launch(32 if switches and bd == 128 else big, 32, bp, 8 if switches and bd >= 64 else warps)
    if kernel == "bwd_dkdv":  # 64 key rows spill on sm_80 at D = 64 (mma.sync keeps dK and dV in registers)
        return launch(32, 32, 16, warps)
    return launch(32, 32, bp, warps)


def _seed_words(seed: int) -> tuple[int, int]:
    """64-bit seed -> two signed 32-bit kernel arguments (always i32, so no re-specialisation by value)."""
    seed &= (1 << 64) - 1
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    return (lo - (1 << 32) if lo >= 1 << 31 else lo), (hi - (1 << 32) if hi >= 1 << 31 else hi)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def batch_chunks(batch: int, programs_per_chunk: int, device: torch.device) -> int:
    """How many batch chunks the prefix-gradient kernel splits the batch into (its grid's second axis)."""
    if device.type == "cuda":
        target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return max(1, min(batch, triton.cdiv(target, programs_per_chunk)))
    return min(batch, 2)  # interpreter: every program instance costs ~20 ms


# ------------------------------------------------------------------------------------------------
# launchers (plain tensors in, tensors out; no autograd here)


def _prefix_views(prefix: torch.Tensor):
    """(Hkv, P, D) or (T, Hkv, P, D) -> a (T, Hkv, P, D) view with unit last stride."""
    if prefix.stride(-1) != 1:
        prefix = prefix.contiguous()
    if prefix.dim() == 3:
        prefix = prefix.unsqueeze(0)
    return prefix


def _last_dim_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def token_window(causal: bool, window: tuple[int, int]) -> tuple[int, int, bool]:
    """The token block's visibility in kernel form: ``(win_left, win_right, masked)`` such that token j is
    visible to row i iff ``i - win_left <= j <= i + win_right``; causal folded in (win_right <= 0), -1
    (unbounded) as :data:`UNBOUNDED`; ``masked`` False when nothing is hidden (then the kernels skip the test)."""
    left, right = (int(w) for w in window)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    masked = left >= 0 or right >= 0
    return (UNBOUNDED if left < 0 else min(left, UNBOUNDED), UNBOUNDED if right < 0 else min(right, UNBOUNDED),
            masked)


@dataclass
class _Operands:
    """What every launcher passes: the inputs with unit last strides, (T, Hkv, P, D) prefix views, the
    padding mask as bytes (all ones with a zero stride when None), the prompt index (0 with a zero stride
    when None), the example bounds (CU, stride_cu: see "device helpers"), the bias broadcast to (B, H, S, S)
    strides (q as a placeholder when None), the token window and the sizes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pk: torch.Tensor
    pv: torch.Tensor
    mask: torch.Tensor
    stride_mb: int
    pidx: torch.Tensor
    stride_pidx: int
    cu: torch.Tensor
    stride_cu: int
    bias: torch.Tensor | None
    bias_strides: tuple
    packed: bool
    B: int
    H: int
    S: int
    P: int
    D: int
    T: int
    group: int
    win_left: int
    win_right: int
    masked: bool

    def rows(self, x: torch.Tensor) -> tuple:
        """Batch, head and row strides of a (B, heads, S, D) tensor; batch stride 0 when packed (one slice)."""
        return (0 if self.packed else x.stride(0)), x.stride(1), x.stride(2)

    def stats(self, x: torch.Tensor) -> tuple:
        """Batch and head strides of a (B, H, S) row statistic (lse, delta), the row stride being 1."""
        return (0 if self.packed else x.stride(0)), x.stride(1)

    def prefix(self) -> tuple:
        """Prompt, head and row strides of both prefix views (prompt stride 0 for a single prompt)."""
        return (self.pk.stride(0) if self.T > 1 else 0, *self.pk.stride()[1:3],
                self.pv.stride(0) if self.T > 1 else 0, *self.pv.stride()[1:3])

    def sizes(self) -> tuple:
        return self.H, self.S, self.P, self.D, self.group, self.win_left, self.win_right


def _operands(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, causal, window, attn_bias, cu_seqlens,
              max_seqlen) -> _Operands:
    q, k, v = (_last_dim_unit(x) for x in (q, k, v))
    pk, pv = _prefix_views(prefix_k), _prefix_views(prefix_v)
    _, H, rows, D = q.shape
    packed = cu_seqlens is not None
    if packed:
        if max_seqlen is None or int(max_seqlen) < 1:
            raise ValueError(f"a packed batch (cu_seqlens) needs max_seqlen >= 1, got {max_seqlen}")
        B, S = cu_seqlens.numel() - 1, int(max_seqlen)
        cu, stride_cu = cu_seqlens.to(torch.int32).contiguous(), 1
    else:
        B, S = q.shape[0], rows
        cu, stride_cu = torch.arange(0, 2 * S, S, dtype=torch.int32, device=q.device), 0  # [0, S] for everyone
    if key_padding_mask is None:
        mask, stride_mb = torch.ones(max(S, 1), dtype=torch.uint8, device=q.device), 0
    else:
        mask = key_padding_mask.contiguous().view(torch.uint8)
        stride_mb = mask.stride(0)
    if prompt_index is None:
        pidx, stride_pidx = torch.zeros(1, dtype=torch.int64, device=q.device), 0
    else:
        pidx, stride_pidx = prompt_index, prompt_index.stride(0)
    bias, bias_strides = None, (0, 0, 0)
    if attn_bias is not None:  # its own dtype when it is q's or float32 (read as float32 either way)
        bias = attn_bias if attn_bias.dtype in (q.dtype, torch.float32) else attn_bias.float()
        bias = _last_dim_unit(bias).expand(B, H, S, S)  # broadcast dims get stride 0
        bias_strides = bias.stride()[:3]
    return _Operands(q, k, v, pk, pv, mask, stride_mb, pidx, stride_pidx, cu, stride_cu, bias, bias_strides, packed,
                     B, H, S, pk.shape[2], D, pk.shape[0], H // k.shape[1], *token_window(causal, window))


def _prompt_segments(prompt_index, B: int, T: int, device):
    """Examples grouped by prompt (a stable sort, on the device: no host sync) and the (T + 1,) segment
    offsets, as int32 tensors for the prefix-gradient kernel."""
    if prompt_index is None:
        return (torch.arange(B, dtype=torch.int32, device=device),
                torch.tensor([0, B], dtype=torch.int32, device=device))
    order = torch.sort(prompt_index, stable=True).indices.to(torch.int32)
    seg = torch.zeros(T + 1, dtype=torch.int32, device=device)
    seg[1:] = torch.cumsum(torch.bincount(prompt_index, minlength=T)[:T], 0)
    return order, seg


# the feature switches (constexprs) each kernel takes: the token window, the bias, writing the bias gradient
_FLAGS = {"fwd": ("MASKED", "HAS_BIAS"), "bwd_dq": ("MASKED", "HAS_BIAS", "BIAS_GRAD"),
          "bwd_dkdv": ("MASKED", "HAS_BIAS"), "bwd_prefix": ()}


def _constexprs(kernel: str, S: int, P: int, D: int, dtype: torch.dtype, dropout: bool, upcast: bool,
                dot_prec: str, masked: bool = False, bias: bool = False, bias_grad: bool = False):
    """Compile-time arguments and launch options of ``kernel`` (shared with :func:`aot_specs`)."""
    cfg = config(kernel, S, P, D, dtype, dropout, masked or bias, dot_prec == "tf32")
    flags = dict(MASKED=masked, HAS_BIAS=bias, BIAS_GRAD=bias_grad)
    return (dict(DROPOUT=dropout, UPCAST=upcast, DOT_PREC=dot_prec, **{f: flags[f] for f in _FLAGS[kernel]},
                 **cfg.tiles), cfg.options())


def forward(q, k, v, prefix_k, prefix_v, key_padding_mask=None, prompt_index=None, *, scale: float,
            dropout_p: float = 0.0, seed: int = 0, causal: bool = False, window=(-1, -1), attn_bias=None,
            cu_seqlens=None, max_seqlen=None):
    """Launch the forward kernel. Returns ``(out, lse fp32)`` in q's layout: (B, H, S, D) and (B, H, S), or
    (1, H, N, D) and (1, H, N) packed (``cu_seqlens``, ``max_seqlen`` at least the longest sequence).

    ``out`` has the memory layout of ``torch.empty(B, S, H, D).transpose(1, 2)``, so the caller's
    ``out.transpose(1, 2).reshape(B, S, H * D)`` is free.
    """
    op = _operands(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, causal, window, attn_bias,
                   cu_seqlens, max_seqlen)
    q = op.q
    out = torch.empty((q.shape[0], q.shape[2], op.H, op.D), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if interpreting():  # poison: every element must be written by the kernel
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    consts, opts = _constexprs("fwd", op.S, op.P, op.D, q.dtype, dropout_p > 0, upcast(q.dtype),
                               dot_precision(q.dtype), op.masked, op.bias is not None)
    lo, hi = _seed_words(seed)
    _fwd_kernel[(triton.cdiv(op.S, consts["BLOCK_M"]), op.B * op.H)](
        q, op.k, op.v, op.pk, op.pv, op.pidx, op.mask, op.cu, q if op.bias is None else op.bias, out, lse,
        *op.rows(q), *op.rows(op.k), *op.rows(op.v), *op.prefix(),
        op.stride_pidx, op.stride_mb, op.stride_cu, *op.bias_strides, *op.rows(out), *op.stats(lse),
        *op.sizes(), float(scale), float(dropout_p), lo, hi, **consts, **opts,
    )
    return out, lse


def backward(dout, q, k, v, prefix_k, prefix_v, out, lse, key_padding_mask=None, prompt_index=None, *,
             scale: float, dropout_p: float = 0.0, seed: int = 0, causal: bool = False, window=(-1, -1),
             attn_bias=None, cu_seqlens=None, max_seqlen=None, bias_grad: bool = False):
    """Launch the three backward kernels. Returns ``(dq, dk, dv, dprefix_k, dprefix_v, dbias)``: dq/dk/dv with
    the strides of q/k/v (when those are dense), the prefix gradients with the prefix's shape and dtype, summed
    over the batch and the query heads of each key/value head (per prompt with ``prompt_index``), and with
    ``bias_grad`` the gradient of ``attn_bias`` in its shape and dtype (summed over its broadcast dimensions;
    None otherwise)."""
    op = _operands(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, causal, window, attn_bias,
                   cu_seqlens, max_seqlen)
    q, k, v = op.q, op.k, op.v
    dout, out = _last_dim_unit(dout), _last_dim_unit(out)
    B, H, S, P, D, T = op.B, op.H, op.S, op.P, op.D, op.T
    dropout, up, prec = dropout_p > 0, upcast(q.dtype), dot_precision(q.dtype)
    has_bias, bias_grad = op.bias is not None, bias_grad and op.bias is not None
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if interpreting():
        for x in (dq, dk, dv, delta):
            x.fill_(float("nan"))
    # zeros: the kernel writes only the (row, token) pairs some window lets the row see, within its sequence
    dbias = torch.zeros((B, H, S, S), dtype=torch.float32, device=q.device) if bias_grad else delta
    bias = q if op.bias is None else op.bias
    lo, hi = _seed_words(seed)
    consts, opts = _constexprs("bwd_dq", S, P, D, q.dtype, dropout, up, prec, op.masked, has_bias, bias_grad)
    _bwd_dq_kernel[(triton.cdiv(S, consts["BLOCK_M"]), B * H)](
        q, k, v, op.pk, op.pv, op.pidx, op.mask, op.cu, bias, out, dout, lse, delta, dq, dbias,
        *op.rows(q), *op.rows(k), *op.rows(v), *op.prefix(),
        op.stride_pidx, op.stride_mb, op.stride_cu, *op.bias_strides,
        *op.rows(out), *op.rows(dout), *op.rows(dq), *op.stats(lse),
        *(dbias.stride()[:3] if bias_grad else (0, 0, 0)),
        *op.sizes(), float(scale), float(dropout_p), lo, hi, **consts, **opts,
    )
    consts, opts = _constexprs("bwd_dkdv", S, P, D, q.dtype, dropout, up, prec, op.masked, has_bias)
    _bwd_dkdv_kernel[(triton.cdiv(S, consts["BLOCK_N"]), B * (H // op.group))](
        q, k, v, op.mask, op.cu, bias, dout, lse, delta, dk, dv,
        *op.rows(q), *op.rows(k), *op.rows(v), op.stride_mb, op.stride_cu, *op.bias_strides,
        *op.rows(dout), *op.rows(dk), *op.rows(dv), *op.stats(lse),
        *op.sizes(), float(scale), float(dropout_p), lo, hi, **consts, **opts,
    )
    consts, opts = _constexprs("bwd_prefix", S, P, D, q.dtype, dropout, up, prec)
    n_pblocks = triton.cdiv(P, consts["BLOCK_P"])
    n_kv_heads = H // op.group
    chunk = triton.cdiv(B, batch_chunks(B, max(1, T * n_kv_heads * n_pblocks), q.device))
    chunks = triton.cdiv(B, chunk)
    dpk_part = torch.zeros((chunks, T, n_kv_heads, P, D), dtype=torch.float32, device=q.device)
    dpv_part = torch.zeros_like(dpk_part)
    if P > 0:
        order, seg = _prompt_segments(prompt_index, B, T, q.device)
        _bwd_prefix_kernel[(T * n_kv_heads * n_pblocks, chunks)](
            q, op.pk, op.pv, order, seg, op.cu, dout, lse, delta, dpk_part, dpv_part,
            *op.rows(q), *op.prefix(), op.stride_cu, *op.rows(dout), *op.stats(lse),
            H, S, P, D, T, op.group, chunk, float(scale), float(dropout_p), lo, hi, **consts, **opts,
        )
    # Deterministic reductions of partial sums (fixed-order torch reductions, no atomics).
    dpk = dpk_part.sum(0).to(prefix_k.dtype).reshape(prefix_k.shape)
    dpv = dpv_part.sum(0).to(prefix_v.dtype).reshape(prefix_v.shape)
    if bias_grad:
        dbias = dbias.sum_to_size(attn_bias.shape).to(attn_bias.dtype)
    return dq, dk, dv, dpk, dpv, dbias if bias_grad else None


# ------------------------------------------------------------------------------------------------
# ahead-of-time specialisations

# One representative (S, P) per bucket of config(): S <= 32 or not, P <= 16 or not.
_S_BUCKETS = (32, 64)
_P_BUCKETS = (16, 64)


def _feature_variants(kernel: str, ty: str) -> list[tuple[bool, bool, bool, str]]:
    """(masked, bias, bias_grad, bias pointer type) of every feature switch combination ``kernel`` takes: the
    token window (causal or sliding) on/off, no bias / a bias / a bias and its gradient, the bias in the input
    type or (for half inputs) in float32. Varlen (packed) batches, grouped-query heads and the window's width
    are runtime values of the same code (``do_not_specialize``), so they add none."""
    flags = _FLAGS[kernel]
    masks = (False, True) if "MASKED" in flags else (False,)
    biases = [(False, False)]
    if "HAS_BIAS" in flags:
        biases += [(True, False)] + ([(True, True)] if "BIAS_GRAD" in flags else [])
    out = []
    for masked in masks:
        for bias, grad in biases:
            for bias_ty in ((ty, "fp32") if bias and ty != "fp32" else (ty,)):
                out.append((masked, bias, grad, bias_ty))
    return out


def aot_specs(full: bool = False) -> list[KernelSpec]:
    """The distinct specialisations the launchers compile on a GPU (``full``), or the CI subset.

    ``full`` enumerates :func:`config` over its whole domain: 4 kernels x dtype (fp16, bf16, fp32 with "ieee"
    and "tf32" dots) x dropout on/off x BLOCK_D (32, 64, 128) x the S and P buckets x the feature switches of
    :func:`_feature_variants`, deduplicated. The CI subset keeps what is most likely to fail: the largest tiles
    (S > 32, P > 16) with dropout on (the most live registers) for fp16 at BLOCK_D 64 and 128 (bf16 gets the
    same tiles) and for fp32-ieee at BLOCK_D 128, each with every switch on (window, bias, bias gradient: the
    most live registers again) and off, plus the dropout-off BERT-base shape (S = 32, P = 16, D = 64) of the
    benchmark.
    """
    precisions = [(dt, "ieee") for dt in TRITON_TYPE] + [(torch.float32, "tf32")]
    if full:
        grid = [(dt, prec, drop, d, S, P, None) for dt, prec in precisions for drop in (True, False)
                for d in (32, 64, 128) for S in _S_BUCKETS for P in _P_BUCKETS]
    else:
        heavy = [(torch.float16, "ieee", True, 64, 64, 64), (torch.float16, "ieee", True, 128, 64, 64),
                 (torch.float32, "ieee", True, 128, 64, 64)]
        grid = ([(*g, "plain") for g in heavy] + [(*g, "all") for g in heavy]
                + [(torch.float16, "ieee", False, 64, 32, 16, "plain")])
    specs, seen = [], set()
    for dt, prec, drop, d, S, P, which in grid:
        ty = TRITON_TYPE[dt]
        for kernel in KERNELS:
            variants = _feature_variants(kernel, ty)
            if which == "plain":
                variants = variants[:1]
            elif which == "all":
                variants = [max(variants, key=lambda f: (f[0], f[1], f[2], f[3] == ty))]
            for masked, bias, grad, bias_ty in variants:
                consts, opts = _constexprs(kernel, S, P, d, dt, drop, upcast=False, dot_prec=prec, masked=masked,
                                           bias=bias, bias_grad=grad)
                key = (kernel, ty, bias_ty, tuple(sorted(consts.items())), tuple(sorted(opts.items())))
                if key in seen:
                    continue
                seen.add(key)
                tiles = "_".join(f"{k[6:].lower()}{v}" for k, v in consts.items() if k.startswith("BLOCK_"))
                switches = (("_drop" if drop else "") + ("_win" if masked else "")
                            + (f"_bias{'32' if bias_ty != ty else ''}" if bias else "") + ("_dbias" if grad else ""))
                name = f"{kernel}_{ty}{'_tf32' if prec == 'tf32' else ''}_{tiles}{switches}"
                sig = _signature(kernel, ty, bias_ty)
                specs.append(KernelSpec(name, _KERNEL_FNS[kernel], sig, consts, divisible_by_16=_aligned(sig), **opts))
    return specs


_KERNEL_FNS = {"fwd": _fwd_kernel, "bwd_dq": _bwd_dq_kernel, "bwd_dkdv": _bwd_dkdv_kernel,
               "bwd_prefix": _bwd_prefix_kernel}
check_interpreted(*_KERNEL_FNS.values())
_RUNTIME_TYPES = {"sm_scale": "fp32", "dropout_p": "fp32", "PIDX": "*i64", "ORDER": "*i32", "SEG": "*i32",
                  "CU": "*i32", "MASK": "*u8", "LSE": "*fp32", "DELTA": "*fp32", "DPK": "*fp32", "DPV": "*fp32",
                  "DBIAS": "*fp32"}


def _signature(kernel: str, ty: str, bias_ty: str | None = None) -> dict:
    """Triton types of the runtime arguments: tensors of the input dtype (the bias: ``bias_ty``), fp32
    statistics, i32 integers."""
    fn = _KERNEL_FNS[kernel].fn if hasattr(_KERNEL_FNS[kernel], "fn") else _KERNEL_FNS[kernel]
    import inspect

    params = [n for n, prm in inspect.signature(fn).parameters.items()
              if "constexpr" not in str(prm.annotation)]
    ints = {"B", "H", "S", "P", "D", "T"}
    types = dict(_RUNTIME_TYPES, BIAS=f"*{bias_ty or ty}")
    return {n: types.get(n, f"*{ty}" if n.isupper() and n not in ints else "i32") for n in params}


# runtime integers that are not multiples of 16 in the usual layouts: S-dependent strides (mask, statistics,
# bias and its gradient), and the values the kernels do not specialise on (do_not_specialize)
_GENERIC = {"stride_mb", "stride_pidx", "stride_lb", "stride_lh", "stride_biasb", "stride_biash", "stride_biasm",
            "stride_dbb", "stride_dbh", "stride_dbm", "stride_cu"}


def _aligned(sig: dict) -> tuple:
    """Arguments Triton's launcher sees as 16-divisible for the usual layouts: 16-byte aligned storage, D a
    multiple of 16 and strides derived from it (zero batch strides of packed batches too). S-dependent
    arguments (mask, statistics and bias strides, lengths) stay generic. (The last-dim strides are 1 by
    construction and are not arguments.)"""
    return tuple(n for n, ty in sig.items()
                 if ty.startswith("*") or (n.startswith("stride_") and n not in _GENERIC) or n == "D")

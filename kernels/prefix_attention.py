"""Triton kernels of the fused prefix attention (``fastprompt.ops.prefix_attention``): FlashAttention-2's split,
attending to ``[prefix ; tokens]`` without materialising the concatenation: one forward kernel, and a backward of
two, one dQ kernel (which also stores ``delta = rowsum(dO * O)`` and the bias gradient) and one dK/dV kernel whose
grid covers the token key tiles and the prefix key tiles (the prefix gradient as per-program partial sums over
batch chunks, reduced in a fixed order). With them: the launchers (plain tensors in, tensors out; no autograd
here, ``fastprompt/ops/attention.py`` wraps them), the one function that chooses launch parameters
(:func:`config`, keyed by a :class:`ShapeClass`), the candidates a tuner may time (:func:`tune_space`) and the
ahead-of-time specialisations (:func:`aot_specs`). How they work: ``docs/ops/prefix_attention.md`` ("The Triton
kernels in detail").

The launchers read no tensor value on the host (no ``.item()``, no host copies): sizes come from shapes and
host ints, the dropout seed is a device tensor the kernels load, the packed offsets are read on the device.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
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
# ``start`` of its batch slice: padded batches (VARLEN off) are rows 0..S of slice b, packed ones (VARLEN on)
# read cu_seqlens and have zero batch strides (every sequence: its rows of the one (1, H, N, D) slice). S is the
# padded length, or max_seqlen when packed: the dropout counter's row length and the attention bias' side. Token
# positions (causal/window masks, bias, dropout) count from start. Absent options (padding mask, prompt index)
# are compile-time switches, not dummy tensors.


@triton.jit
def _seed(SEED):
    """The dropout seed's two 32-bit words, loaded from the 0-d int64 tensor the host passes (drawn on the device:
    a captured CUDA graph draws a new mask per replay). The low word is Philox's key (sign-extended, as Triton
    widens a 32-bit seed), the high word the counter's third word."""
    s = tl.load(SEED)
    return s.to(tl.int32), (s >> 32).to(tl.int32)


@triton.jit
def _select4(off, a, b, c, d):
    return tl.where(off == 0, a, tl.where(off == 1, b, tl.where(off == 2, c, d)))


@triton.jit
def _keep(seed_lo, seed_hi, bh, rows, c0, n_cols, dropout_p, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Dropout keep-mask of a (BLOCK_R rows x BLOCK_C columns) tile of the virtual concatenation, rows ``rows``,
    columns c0..c0+BLOCK_C: element e = row * n_cols + col (mod 2^32) reads word e % 4 of Philox at counter
    (e // 4, bh, seed_hi, 0), as the C++ kernel does (csrc/philox.h).

    Each row draws the BLOCK_C / 4 groups (Philox calls) from its first element's group g0. When n_cols and c0
    are multiples of 4 every row starts on a group boundary and those words, in element order, are the tile's:
    one call per four probabilities. Otherwise a row's first element is word ``off`` = e0 % 4 of g0 (``off``
    differs from row to row) and element 4 j + w is word (w + off) % 4 of group j or, past the group's end, of
    group j + 1: the groups from g0 + 1 are drawn too (two calls per four) and each of the four word positions
    picks its word by ``off``. (A gather along the row would need one call per four, but its lowering spilled.)"""
    e0 = (rows * n_cols + c0).to(tl.uint32)
    c = (e0 >> 2)[:, None] + tl.arange(0, BLOCK_C // 4).to(tl.uint32)[None, :]
    z = c * 0
    c1 = z + bh
    c2 = z + seed_hi.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed_lo, c, c1, c2, z)
    if ((n_cols | c0) & 3) != 0:  # rows start inside a group
        s0, s1, s2, _ = tl.philox(seed_lo, c + 1, c1, c2, z)
        off = (e0 & 3)[:, None]
        r0, r1, r2, r3 = (_select4(off, r0, r1, r2, r3), _select4(off, r1, r2, r3, s0),
                          _select4(off, r2, r3, s0, s1), _select4(off, r3, s0, s1, s2))
    # word w of group j at position 4 j + w
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BLOCK_R, BLOCK_C))
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _seq(CU, b, S, VARLEN: tl.constexpr):
    """Example b's first row in its batch slice and its number of rows (a packed sequence longer than S =
    max_seqlen is cut to S; the op checks on the device that there is none)."""
    if VARLEN:
        start = tl.load(CU + b)
        seqlen = tl.minimum(tl.load(CU + b + 1) - start, S)
    else:
        start = 0
        seqlen = S
    return start, seqlen


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
def _prefix_kv(PK, PV, PIDX, b, kvh, n_kv_heads, P, D, HAS_PIDX: tl.constexpr):
    """Example b's prompt (its ``prompt_index`` entry; 0 without one) at key/value head kvh: base pointers into
    the contiguous (T, Hkv, P, D) prefixes."""
    if HAS_PIDX:
        t = tl.load(PIDX + b)
    else:
        t = 0
    base = (t * n_kv_heads + kvh) * P * D
    return PK + base, PV + base


@triton.jit
def _token_keys(MASK, b, n0, seqlen, S, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """Token key rows n0..n0+BLOCK_N of example b: offsets, in the sequence, and visible (not padding)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seqlen
    n_vis = n_ok
    if HAS_MASK:  # (B, S) bytes, contiguous
        n_vis = n_ok & (tl.load(MASK + b * S + offs_n, mask=n_ok, other=0) != 0)
    return offs_n, n_ok, n_vis


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
def _softmax_step(acc, m_i, l_i, s, v, vis, c0, offs_m, n_cols, dropout_p, seed_lo, seed_hi, bh,
                  DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """The online-softmax update of the forward with one key tile (scores s, visibility vis, first column c0)."""
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        p = tl.where(_keep(seed_lo, seed_hi, bh, offs_m, c0, n_cols, dropout_p, BLOCK_M, BLOCK_C), p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# ------------------------------------------------------------------------------------------------
# forward


@triton.jit(do_not_specialize=["group", "win_left", "win_right"])
def _fwd_kernel(
    Q, K, V, PK, PV, PIDX, MASK, CU, BIAS, SEED, O, LSE,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_biasb, stride_biash, stride_biasm,
    H, S, P, D, N, group, win_left, win_right, sm_scale, dropout_p,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PIDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid (cdiv(S, BLOCK_M), B * H). O is the (B, S, H, D) buffer (packed (1, N, H, D)) seen as (B, H, S, D); LSE
    # is (B, H, S) (packed (1, H, N)): N is the number of rows of a batch slice.
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start, seqlen = _seq(CU, b, S, VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < seqlen:  # a packed sequence shorter than max_seqlen has fewer row tiles
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < seqlen
        kvh = h // group
        q = _load_rows(Q + b * stride_qb + h * stride_qh + start * stride_qs, offs_m, offs_d,
                       m_ok[:, None] & d_ok[None, :], stride_qs, UPCAST)
        qk_scale = sm_scale * LOG2E
        n_cols = P + S
        seed_lo, seed_hi = 0, 0
        if DROPOUT:
            seed_lo, seed_hi = _seed(SEED)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        pk, pv = _prefix_kv(PK, PV, PIDX, b, kvh, H // group, P, D, HAS_PIDX)
        for n0 in range(0, P, BLOCK_P):  # the prefix: always visible
            offs_n = n0 + tl.arange(0, BLOCK_P)
            ok = offs_n < P
            _, v, s = _kv_scores(q, pk, pv, offs_n, offs_d, d_ok, ok, D, D, qk_scale, UPCAST, DOT_PREC)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, ok[None, :], n0, offs_m, n_cols, dropout_p,
                                          seed_lo, seed_hi, bh, DROPOUT, DOT_PREC, BLOCK_M, BLOCK_P)
        kb = K + b * stride_kb + kvh * stride_kh + start * stride_ks
        vb = V + b * stride_vb + kvh * stride_vh + start * stride_vs
        biasb = BIAS + b * stride_biasb + h * stride_biash
        lo, hi = _span(m0, tl.minimum(m0 + BLOCK_M, seqlen) - 1, seqlen, win_left, win_right, BLOCK_N, MASKED)
        for n0 in range(lo, hi, BLOCK_N):  # the token tiles these rows can see
            offs_n, _, n_vis = _token_keys(MASK, b, n0, seqlen, S, BLOCK_N, HAS_MASK)
            _, v, s, vis = _token_tile(q, kb, vb, biasb, offs_m, m_ok, offs_n, n_vis, offs_d, d_ok, stride_ks,
                                       stride_vs, stride_biasm, qk_scale, win_left, win_right, UPCAST, DOT_PREC,
                                       MASKED, HAS_BIAS)
            acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, vis, P + n0, offs_m, n_cols, dropout_p,
                                          seed_lo, seed_hi, bh, DROPOUT, DOT_PREC, BLOCK_M, BLOCK_N)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if DROPOUT:
            out = out * (1.0 / (1.0 - dropout_p))
        lse = tl.where(l_i == 0.0, float("-inf"), m_i * LN2 + tl.log(l_safe))
        rows = start + offs_m
        o_batch = 0 if VARLEN else b * S * H * D
        tl.store(O + o_batch + h * D + rows[:, None] * (H * D) + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])
        tl.store(LSE + _stats_row(b, h, H, N, VARLEN) + rows, lse, mask=m_ok)


@triton.jit
def _stats_row(b, h, H, N, VARLEN: tl.constexpr):
    """Offset of example b, head h's first row in a (B, H, N) row statistic (lse, delta; packed: (1, H, N))."""
    if VARLEN:
        return h * N
    else:
        return (b * H + h) * N


# ------------------------------------------------------------------------------------------------
# backward: dQ (with delta and the bias gradient)


@triton.jit
def _dq_step(dq, s, k, v, vis, do, lse2, delta, c0, offs_m, n_cols, dropout_p, seed_lo, seed_hi, bh,
             DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """dQ += dS K for one key tile (first column c0); also returns dS (the gradient of the scaled scores, natural
    units)."""
    p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    if DROPOUT:
        keep = _keep(seed_lo, seed_hi, bh, offs_m, c0, n_cols, dropout_p, BLOCK_M, BLOCK_C)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC), ds


@triton.jit(do_not_specialize=["group", "win_left", "win_right"])
def _bwd_dq_kernel(
    Q, K, V, PK, PV, PIDX, MASK, CU, BIAS, SEED, O, DO, LSE, DELTA, DQ, DBIAS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_biasb, stride_biash, stride_biasm, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    H, S, P, D, N, group, win_left, win_right, sm_scale, dropout_p,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr, BIAS_GRAD: tl.constexpr, VARLEN: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_PIDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid (cdiv(S, BLOCK_M), B * H); DBIAS is a zeroed (B, H, S, S) float32 buffer
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start, seqlen = _seq(CU, b, S, VARLEN)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < seqlen:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        m_ok = offs_m < seqlen
        kvh = h // group
        md = m_ok[:, None] & d_ok[None, :]
        q = _load_rows(Q + b * stride_qb + h * stride_qh + start * stride_qs, offs_m, offs_d, md, stride_qs, False)
        do = _load_rows(DO + b * stride_dob + h * stride_doh + start * stride_dos, offs_m, offs_d, md, stride_dos,
                        False)
        o = _load_rows(O + b * stride_ob + h * stride_oh + start * stride_os, offs_m, offs_d, md, stride_os, False)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        row_stats = _stats_row(b, h, H, N, VARLEN) + start + offs_m
        tl.store(DELTA + row_stats, delta, mask=m_ok)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + row_stats, mask=m_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # empty rows: p = 0
        qk_scale = sm_scale * LOG2E
        n_cols = P + S
        seed_lo, seed_hi = 0, 0
        if DROPOUT:
            seed_lo, seed_hi = _seed(SEED)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        pk, pv = _prefix_kv(PK, PV, PIDX, b, kvh, H // group, P, D, HAS_PIDX)
        for n0 in range(0, P, BLOCK_P):
            offs_n = n0 + tl.arange(0, BLOCK_P)
            ok = offs_n < P
            k, v, s = _kv_scores(q, pk, pv, offs_n, offs_d, d_ok, ok, D, D, qk_scale, UPCAST, DOT_PREC)
            dq, _ = _dq_step(dq, s, k, v, ok[None, :], do, lse2, delta, n0, offs_m, n_cols, dropout_p,
                             seed_lo, seed_hi, bh, DROPOUT, DOT_PREC, BLOCK_M, BLOCK_P)
        kb = K + b * stride_kb + kvh * stride_kh + start * stride_ks
        vb = V + b * stride_vb + kvh * stride_vh + start * stride_vs
        biasb = BIAS + b * stride_biasb + h * stride_biash
        lo, hi = _span(m0, tl.minimum(m0 + BLOCK_M, seqlen) - 1, seqlen, win_left, win_right, BLOCK_N, MASKED)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n, n_ok, n_vis = _token_keys(MASK, b, n0, seqlen, S, BLOCK_N, HAS_MASK)
            k, v, s, vis = _token_tile(q, kb, vb, biasb, offs_m, m_ok, offs_n, n_vis, offs_d, d_ok, stride_ks,
                                       stride_vs, stride_biasm, qk_scale, win_left, win_right, UPCAST, DOT_PREC,
                                       MASKED, HAS_BIAS)
            dq, ds = _dq_step(dq, s, k, v, vis, do, lse2, delta, P + n0, offs_m, n_cols, dropout_p,
                              seed_lo, seed_hi, bh, DROPOUT, DOT_PREC, BLOCK_M, BLOCK_N)
            if BIAS_GRAD:  # dS is the bias gradient; tiles no row sees stay as the host zeroed them
                tl.store(DBIAS + (bh * S + offs_m[:, None]) * S + offs_n[None, :], ds,
                         mask=m_ok[:, None] & n_ok[None, :])
        tl.store(DQ + b * stride_dqb + h * stride_dqh + (start + offs_m[:, None]) * stride_dqs + offs_d[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=md)


# ------------------------------------------------------------------------------------------------
# backward: dK, dV of the token key tiles and the prefix key tiles, one launch


@triton.jit
def _kv_tile_grads(dk, dv, k, v, n_vis, offs_n, c0, qb, dob, lseb, deltab, biasb, bh, lo, hi, seqlen, offs_d, d_ok,
                   stride_qs, stride_dos, stride_biasm, qk_scale, n_cols, win_left, win_right, dropout_p, seed_lo,
                   seed_hi, DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
                   MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Accumulate dK, dV of one key/value tile (key rows offs_n, visible where n_vis; first dropout column c0)
    over query rows lo..hi of one example and query head (pointers qb, dob, lseb, deltab, biasb at its first
    row), in transposed form (keys x queries)."""
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
            keep = tl.trans(_keep(seed_lo, seed_hi, bh, offs_m, c0, n_cols, dropout_p, BLOCK_M, BLOCK_N))
            inv = 1.0 / (1.0 - dropout_p)
            pd_t = tl.where(keep, p_t * inv, 0.0)
            dp_t = tl.where(keep, dp_t * inv, 0.0)
        else:
            pd_t = p_t
        dv += tl.dot(pd_t.to(do.dtype), do, input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PREC)
    return dk, dv


@triton.jit(do_not_specialize=["group", "win_left", "win_right", "T", "B", "n_chunks", "chunk"])
def _bwd_dkdv_kernel(
    Q, K, V, PK, PV, PIDX, MASK, CU, BIAS, SEED, DO, LSE, DELTA, DK, DV, DPART,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_biasb, stride_biash, stride_biasm, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    H, S, P, D, N, group, win_left, win_right, T, B, n_chunks, chunk, sm_scale, dropout_p,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PIDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # 1-D grid: first the prefix programs (T * Hkv * cdiv(P, BLOCK_P) * n_chunks: the longer ones, started
    # first), then the token programs (B * Hkv * cdiv(S, BLOCK_N)). Every program owns one key tile of one
    # key/value head and sums over the query heads of its group, in order (deterministic, no atomics).
    n_kv_heads = H // group
    n_pblocks = tl.cdiv(P, BLOCK_P)
    n_prefix = T * n_kv_heads * n_pblocks * n_chunks
    pid = tl.program_id(0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    qk_scale = sm_scale * LOG2E
    n_cols = P + S
    seed_lo, seed_hi = 0, 0
    if DROPOUT:
        seed_lo, seed_hi = _seed(SEED)
    if pid < n_prefix:
        # Prefix tile (t, kvh, tile) over the examples of batch chunk c that use prompt t: a partial sum into
        # DPART (2, n_chunks, T, Hkv, P, D) float32, which the host sums over the chunks in order.
        c = pid % n_chunks
        pt = pid // n_chunks
        tile = pt % n_pblocks
        kvh = (pt // n_pblocks) % n_kv_heads
        t = pt // (n_pblocks * n_kv_heads)
        offs_n = tile * BLOCK_P + tl.arange(0, BLOCK_P)
        n_ok = offs_n < P
        nd = n_ok[:, None] & d_ok[None, :]
        base = (t * n_kv_heads + kvh) * P * D
        k = _load_rows(PK + base, offs_n, offs_d, nd, D, UPCAST)
        v = _load_rows(PV + base, offs_n, offs_d, nd, D, UPCAST)
        dk = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
        for b in range(c * chunk, tl.minimum((c + 1) * chunk, B)):
            mine = True
            if HAS_PIDX:
                mine = tl.load(PIDX + b) == t
            if mine:
                start, seqlen = _seq(CU, b, S, VARLEN)
                for g in range(0, group):
                    h = kvh * group + g
                    stats = _stats_row(b, h, H, N, VARLEN) + start
                    dk, dv = _kv_tile_grads(dk, dv, k, v, n_ok, offs_n, tile * BLOCK_P,
                                            Q + b * stride_qb + h * stride_qh + start * stride_qs,
                                            DO + b * stride_dob + h * stride_doh + start * stride_dos, LSE + stats,
                                            DELTA + stats, Q, b * H + h, 0, seqlen, seqlen, offs_d, d_ok, stride_qs,
                                            stride_dos, 0, qk_scale, n_cols, 0, 0, dropout_p, seed_lo, seed_hi,
                                            DROPOUT, UPCAST, DOT_PREC, False, False, BLOCK_M, BLOCK_P)
        out = (((c * T + t) * n_kv_heads + kvh) * P + offs_n[:, None]) * D + offs_d[None, :]
        tl.store(DPART + out, dk * sm_scale, mask=nd)
        tl.store(DPART + n_chunks * T * n_kv_heads * P * D + out, dv, mask=nd)
    else:
        n_tiles = tl.cdiv(S, BLOCK_N)
        rest = pid - n_prefix
        n0 = (rest % n_tiles) * BLOCK_N
        b = rest // n_tiles // n_kv_heads
        kvh = (rest // n_tiles) % n_kv_heads
        start, seqlen = _seq(CU, b, S, VARLEN)
        if n0 < seqlen:
            offs_n, n_ok, n_vis = _token_keys(MASK, b, n0, seqlen, S, BLOCK_N, HAS_MASK)
            nd = n_ok[:, None] & d_ok[None, :]
            k = _load_rows(K + b * stride_kb + kvh * stride_kh + start * stride_ks, offs_n, offs_d, nd, stride_ks,
                           UPCAST)
            v = _load_rows(V + b * stride_vb + kvh * stride_vh + start * stride_vs, offs_n, offs_d, nd, stride_vs,
                           UPCAST)
            dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            lo, hi = _span(n0, tl.minimum(n0 + BLOCK_N, seqlen) - 1, seqlen, win_right, win_left, BLOCK_M, MASKED)
            for g in range(0, group):
                h = kvh * group + g
                stats = _stats_row(b, h, H, N, VARLEN) + start
                dk, dv = _kv_tile_grads(dk, dv, k, v, n_vis, offs_n, P + n0,
                                        Q + b * stride_qb + h * stride_qh + start * stride_qs,
                                        DO + b * stride_dob + h * stride_doh + start * stride_dos, LSE + stats,
                                        DELTA + stats, BIAS + b * stride_biasb + h * stride_biash, b * H + h, lo, hi,
                                        seqlen, offs_d, d_ok, stride_qs, stride_dos, stride_biasm, qk_scale, n_cols,
                                        win_left, win_right, dropout_p, seed_lo, seed_hi, DROPOUT, UPCAST, DOT_PREC,
                                        MASKED, HAS_BIAS, BLOCK_M, BLOCK_N)
            tl.store(DK + b * stride_dkb + kvh * stride_dkh + (start + offs_n[:, None]) * stride_dks + offs_d[None, :],
                     (dk * sm_scale).to(DK.dtype.element_ty), mask=nd)
            tl.store(DV + b * stride_dvb + kvh * stride_dvh + (start + offs_n[:, None]) * stride_dvs + offs_d[None, :],
                     dv.to(DV.dtype.element_ty), mask=nd)


# ------------------------------------------------------------------------------------------------
# launch parameters: one function chooses them, keyed by a small shape class

KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
# the tile constexprs each kernel takes (BLOCK_M: query rows, BLOCK_N: token key rows, BLOCK_P: prefix key
# rows, BLOCK_D: the head dim padded to a power of two)
_TILES = {kernel: ("BLOCK_M", "BLOCK_N", "BLOCK_P", "BLOCK_D") for kernel in KERNELS}


@dataclass(frozen=True)
class ShapeClass:
    """What the launch parameters depend on (the key of :func:`config_for` and of tuned-config tables):
    ``dtype`` "fp16" / "bf16" / "fp32" (exact products) / "tf32" (fp32 inputs on TF32 tensor cores), ``head_dim``
    D padded to a power of two (>= 32), ``s_bucket`` the padded length (or ``max_seqlen``) rounded up to a power
    of two in 32..256, ``p_bucket`` the prefix length likewise in 16..64, ``dropout`` on/off, ``switches`` a token
    window or an attention bias on (more live registers)."""

    dtype: str
    head_dim: int
    s_bucket: int
    p_bucket: int
    dropout: bool
    switches: bool = False


def _bucket(n: int, lo: int, hi: int) -> int:
    return min(max(lo, triton.next_power_of_2(max(n, 1))), hi)


@functools.lru_cache(maxsize=1024)
def shape_class(S: int, P: int, D: int, dtype: torch.dtype, dropout: bool, switches: bool = False,
                tf32: bool = False) -> ShapeClass:
    """The :class:`ShapeClass` of a launch (``tf32``: fp32 inputs multiplied on TF32 tensor cores)."""
    name = "tf32" if tf32 and dtype == torch.float32 else TRITON_TYPE[dtype]
    return ShapeClass(name, max(32, triton.next_power_of_2(D)), _bucket(S, 32, 256), _bucket(P, 16, 64),
                      bool(dropout), bool(switches))


def _launch(kernel: str, bd: int, M: int, N: int, Pt: int, num_warps: int, num_stages: int = 2,
            maxnreg: int | None = 255) -> LaunchConfig:
    return LaunchConfig(dict(BLOCK_M=M, BLOCK_N=N, BLOCK_P=Pt, BLOCK_D=bd), num_warps, num_stages, maxnreg)


@functools.lru_cache(maxsize=None)
def config_for(kernel: str, sc: ShapeClass) -> LaunchConfig:
    """The default launch parameters of ``kernel`` for shape class ``sc`` (a launch on a GPU with a tuned table
    takes the table's instead: :func:`tuned_config`), chosen (with ``LaunchConfig.maxnreg``) so that no
    specialisation spills on sm_80/sm_90 (``aot_specs`` and the AOT test check every one)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    bd = sc.head_dim
    if sc.dtype in ("fp32", "tf32"):
        # Exact fp32 dots run on FMA units with whole operand rows in registers: 16-row tiles (32-row tiles
        # spill at D = 128, and erratically at D = 64) and 8 warps (4 spilled a few words at every D, with or
        # without a register bound). The dK/dV kernel's row loop is not software-pipelined (which made it spill).
        # At D = 128 exact products take the stages and register bound that compiled without spills for the class
        # (:data:`_FP32_D128`; None = ptxas's own heuristic). TF32 products (tensor cores) take the 255 bound.
        stages, maxnreg = 1 if kernel == "bwd_dkdv" else 2, 255
        if bd == 128 and sc.dtype == "fp32":
            stages, maxnreg = _FP32_D128[kernel, sc.dropout, sc.switches]
        return _launch(kernel, bd, 16, 16, 16, 8, stages, maxnreg)
    M, N, warps, stages, maxnreg = _HALF[kernel, bd, sc.dropout, sc.switches]
    if kernel != "bwd_dkdv" and sc.s_bucket <= 32:  # one 32-key tile covers a short sentence
        N = min(N, 32)
    return _launch(kernel, bd, M, N, 16 if sc.p_bucket <= 16 else 32, warps, stages, maxnreg)


# exact fp32 at D = 128 by (kernel, dropout, switches): (num_stages, maxnreg), measured as _HALF below
_FP32_D128 = {
    ("fwd", True, True): (2, None), ("fwd", True, False): (2, 255),
    ("fwd", False, True): (2, 255), ("fwd", False, False): (2, 255),
    ("bwd_dq", True, True): (1, None), ("bwd_dq", True, False): (2, None),
    ("bwd_dq", False, True): (2, 255), ("bwd_dq", False, False): (2, 255),
    ("bwd_dkdv", True, True): (1, None), ("bwd_dkdv", True, False): (1, 255),
    ("bwd_dkdv", False, True): (1, 255), ("bwd_dkdv", False, False): (1, 255),
}

# fp16/bf16 launch parameters by (kernel, BLOCK_D, dropout, switches): (BLOCK_M, BLOCK_N, num_warps, num_stages,
# maxnreg). The forward and dQ kernels take 64 query rows, the dK/dV kernel 64 key rows: the M dimension of their
# products, one warpgroup's wgmma on sm_90 (mma.sync on sm_80). ptxas allocates registers erratically near the
# 255 bound (a config may spill on one architecture or with fewer switches and not the other), so each entry is
# the first of a list of candidates, fastest first, that compiled without spills on sm_80 and sm_90 for the
# heaviest switch combinations of its class; the AOT check then covers every specialisation.
_HALF = {
    ("fwd", 32, True, True): (64, 32, 4, 3, 255), ("fwd", 32, True, False): (64, 64, 4, 3, 255),
    ("fwd", 32, False, True): (64, 32, 4, 3, 255), ("fwd", 32, False, False): (64, 64, 4, 3, 255),
    ("fwd", 64, True, True): (64, 64, 8, 3, 255), ("fwd", 64, True, False): (64, 64, 4, 3, 255),
    ("fwd", 64, False, True): (64, 64, 4, 3, 255), ("fwd", 64, False, False): (64, 64, 4, 3, 255),
    ("fwd", 128, True, True): (64, 32, 8, 3, 255), ("fwd", 128, True, False): (64, 64, 4, 3, 255),
    ("fwd", 128, False, True): (64, 32, 8, 3, 255), ("fwd", 128, False, False): (64, 64, 4, 3, 255),
    ("bwd_dq", 32, True, True): (64, 32, 4, 3, 255), ("bwd_dq", 32, True, False): (64, 32, 4, 3, 255),
    ("bwd_dq", 32, False, True): (64, 32, 4, 3, 255), ("bwd_dq", 32, False, False): (64, 64, 4, 3, 255),
    ("bwd_dq", 64, True, True): (64, 16, 8, 2, 255), ("bwd_dq", 64, True, False): (64, 32, 8, 2, 255),
    ("bwd_dq", 64, False, True): (64, 16, 8, 2, 255), ("bwd_dq", 64, False, False): (64, 64, 4, 3, 255),
    ("bwd_dq", 128, True, True): (64, 16, 8, 1, None), ("bwd_dq", 128, True, False): (64, 32, 4, 3, 255),
    ("bwd_dq", 128, False, True): (64, 16, 8, 2, 255), ("bwd_dq", 128, False, False): (64, 64, 4, 3, 255),
    ("bwd_dkdv", 32, True, True): (16, 64, 4, 2, 255), ("bwd_dkdv", 32, True, False): (16, 64, 4, 2, 255),
    ("bwd_dkdv", 32, False, True): (32, 64, 4, 3, 255), ("bwd_dkdv", 32, False, False): (32, 64, 4, 3, 255),
    ("bwd_dkdv", 64, True, True): (16, 64, 8, 1, 255), ("bwd_dkdv", 64, True, False): (16, 64, 4, 2, 255),
    ("bwd_dkdv", 64, False, True): (16, 64, 4, 1, 255), ("bwd_dkdv", 64, False, False): (16, 64, 4, 2, 255),
    # dropout and switches at D = 128: under any register bound ptxas spilled a few words; its own heuristic not
    ("bwd_dkdv", 128, True, True): (16, 64, 8, 1, None), ("bwd_dkdv", 128, True, False): (16, 64, 8, 1, 255),
    ("bwd_dkdv", 128, False, True): (32, 64, 8, 2, 255), ("bwd_dkdv", 128, False, False): (32, 64, 8, 2, 255),
}


def config(kernel: str, S: int, P: int, D: int, dtype: torch.dtype, dropout: bool, switches: bool = False,
           tf32: bool = False) -> LaunchConfig:
    """:func:`config_for` of the shape class of a launch (``switches``: a token window or an attention bias is
    on; ``tf32``: fp32 inputs multiplied on TF32 tensor cores)."""
    return config_for(kernel, shape_class(S, P, D, dtype, dropout, switches, tf32))


def tuned_config(kernel: str, sc: ShapeClass, device: torch.device) -> LaunchConfig | None:
    """The launch parameters ``fastprompt tune`` measured fastest for ``kernel`` on this GPU model
    (:mod:`fastprompt.kernels.tuning`: its table's entry nearest to ``sc`` with the same flags), or None (not a GPU,
    no table, no entry, or one measured at another head dim, whose tiles would not fit this one)."""
    if device.type != "cuda":
        return None
    from fastprompt.kernels import tuning

    entry = tuning.tuned_entry("prefix_attention", kernel, dataclasses.asdict(sc), device)
    if entry is None or entry.key.get("head_dim") != sc.head_dim or set(entry.tiles()) != set(_TILES[kernel]):
        return None
    options = entry.options()
    return LaunchConfig(entry.tiles(), options.get("num_warps", 4), options.get("num_stages", 2),
                        options.get("maxnreg"))


def tune_space(kernel: str, sc: ShapeClass) -> list[LaunchConfig]:
    """The candidate launch parameters of ``kernel`` worth timing on a GPU for shape class ``sc`` (the default
    of :func:`config_for` first): tile sizes, warps and pipeline stages. Not all of them compile without spills
    on every GPU: filter them first with the AOT check (``aot_specs(candidates=...)`` builds their
    specialisations; ``fastprompt.kernels.aot.compile_spec`` / ``check_module`` compile them), then time the
    survivors with ``forward(..., config=)`` / ``backward(..., configs=)``."""
    base = config_for(kernel, sc)
    bd = sc.head_dim
    out = [base]

    def add(M, N, Pt, warps, stages, maxnreg=255):
        cfg = _launch(kernel, bd, M, N, Pt, warps, stages, maxnreg)
        if cfg not in out:
            out.append(cfg)

    if sc.dtype == "fp32":  # exact products: FMA tiles
        for M in (16, 32):
            for warps in (8, 4):
                for stages in (1, 2):
                    add(M, 16, 16, warps, stages, base.maxnreg)
        return out
    # 64-row products (query rows; key rows in dK/dV: their M dimension, one warpgroup's wgmma) first
    rows = (64, 128) if kernel != "bwd_dkdv" else (16, 32, 64)
    keys = (64, 32, 16) if kernel != "bwd_dkdv" else (64, 128)
    bp = 16 if sc.p_bucket <= 16 else 32
    for M in rows:
        for N in keys:
            for warps in (4, 8):
                for stages in (3, 2, 1, 4):
                    add(M, N, bp, warps, stages)
    return out


# ------------------------------------------------------------------------------------------------
# launchers (plain tensors in, tensors out; no autograd here)


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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def batch_chunks(batch: int, programs_per_chunk: int, device: torch.device) -> int:
    """How many batch chunks the prefix programs split the batch into: about 4 programs per SM in all on CUDA."""
    if device.type == "cuda":
        target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        return max(1, min(batch, triton.cdiv(target, programs_per_chunk)))
    return min(batch, 2)  # interpreter: every program instance costs ~20 ms


@dataclass(frozen=True)
class _Plan:
    """The cached launch parameters of one call's shape: per kernel its constexprs and launch options, and the
    grids; for the dK/dV kernel the prefix programs' batch chunking."""

    consts: dict
    opts: dict
    grids: dict
    n_chunks: int
    chunk: int


@functools.lru_cache(maxsize=4096)
def _plan(kernels: tuple, B: int, H: int, Hkv: int, S: int, P: int, D: int, T: int, dtype: torch.dtype,
          dropout: bool, upcast_: bool, prec: str, masked: bool, bias: bool, bias_grad: bool, varlen: bool,
          has_mask: bool, has_pidx: bool, device: torch.device, overrides: tuple = ()) -> _Plan:
    """Constexprs, options and grids of ``kernels`` for one call's shape (cached: a call does no arithmetic on
    them): each kernel's launch parameters from ``overrides`` (:func:`_overrides` of the tuner's candidates), else
    this GPU's tuned table (:func:`tuned_config`), else :func:`config_for`'s default."""
    chosen = {k: LaunchConfig(dict(tiles), warps, stages, maxnreg) for k, tiles, warps, stages, maxnreg in overrides}
    consts, opts, grids = {}, {}, {}
    n_chunks = chunk = 1
    sc = shape_class(S, P, D, dtype, dropout, masked or bias, prec == "tf32")
    for kernel in kernels:
        cfg = chosen.get(kernel) or tuned_config(kernel, sc, device) or config_for(kernel, sc)
        consts[kernel] = dict(DROPOUT=dropout, UPCAST=upcast_, DOT_PREC=prec,
                              **_flag_values(kernel, masked, bias, bias_grad, varlen, has_mask, has_pidx), **cfg.tiles)
        opts[kernel] = cfg.options()
        t = cfg.tiles
        if kernel == "bwd_dkdv":
            n_pblocks = triton.cdiv(P, t["BLOCK_P"])
            per_chunk = T * Hkv * n_pblocks
            n_chunks = batch_chunks(B, max(1, per_chunk), device) if P > 0 else 1
            chunk = triton.cdiv(B, n_chunks)
            n_chunks = triton.cdiv(B, chunk)
            grids[kernel] = (per_chunk * n_chunks + B * Hkv * triton.cdiv(S, t["BLOCK_N"]),)
        else:
            grids[kernel] = (triton.cdiv(S, t["BLOCK_M"]), B * H)
    return _Plan(consts, opts, grids, n_chunks, chunk)


# the feature switches (constexprs) each kernel takes besides DROPOUT / UPCAST / DOT_PREC
_FLAGS = {"fwd": ("MASKED", "HAS_BIAS", "VARLEN", "HAS_MASK", "HAS_PIDX"),
          "bwd_dq": ("MASKED", "HAS_BIAS", "BIAS_GRAD", "VARLEN", "HAS_MASK", "HAS_PIDX"),
          "bwd_dkdv": ("MASKED", "HAS_BIAS", "VARLEN", "HAS_MASK", "HAS_PIDX")}


def _flag_values(kernel, masked, bias, bias_grad, varlen, has_mask, has_pidx) -> dict:
    values = dict(MASKED=masked, HAS_BIAS=bias, BIAS_GRAD=bias_grad, VARLEN=varlen, HAS_MASK=has_mask,
                  HAS_PIDX=has_pidx)
    return {f: values[f] for f in _FLAGS[kernel]}


def _constexprs(kernel: str, S: int, P: int, D: int, dtype: torch.dtype, dropout: bool, upcast: bool,
                dot_prec: str, masked: bool = False, bias: bool = False, bias_grad: bool = False,
                varlen: bool = False, has_mask: bool = True, has_pidx: bool = False, cfg: LaunchConfig | None = None):
    """Compile-time arguments and launch options of ``kernel`` (what :func:`aot_specs` compiles; the launchers
    get the same through :func:`_plan`)."""
    cfg = cfg or config(kernel, S, P, D, dtype, dropout, masked or bias, dot_prec == "tf32")
    return (dict(DROPOUT=dropout, UPCAST=upcast, DOT_PREC=dot_prec,
                 **_flag_values(kernel, masked, bias, bias_grad, varlen, has_mask, has_pidx), **cfg.tiles),
            cfg.options())


def _overrides(configs: dict | None) -> tuple:
    """``{kernel: LaunchConfig}`` as a hashable key of :func:`_plan`."""
    if not configs:
        return ()
    return tuple((k, tuple(sorted(c.tiles.items())), c.num_warps, c.num_stages, c.maxnreg)
                 for k, c in sorted((configs or {}).items()))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dense(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_contiguous() else x.contiguous()


class _Operands:
    """What every launcher passes: the inputs with unit last strides, the prefixes as contiguous (T, Hkv, P, D)
    tensors, the padding mask as bytes, the prompt index and offsets as int64 (absent ones: ``None``, and the
    kernels' switches off), the bias broadcast to (B, H, S, S) strides, the token window and the sizes. Nothing
    here reads a tensor's values."""

    __slots__ = ("q", "k", "v", "pk", "pv", "mask", "pidx", "cu", "bias", "bias_strides", "varlen", "B", "H", "Hkv",
                 "S", "P", "D", "T", "N", "win_left", "win_right", "masked")

    def __init__(self, q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, causal, window, attn_bias,
                 cu_seqlens, max_seqlen):
        self.q, self.k, self.v = _unit_last(q), _unit_last(k), _unit_last(v)
        pk, pv = _dense(prefix_k), _dense(prefix_v)
        self.T = pk.shape[0] if pk.dim() == 4 else 1
        self.pk, self.pv = pk, pv
        _, self.H, rows, self.D = q.shape
        self.Hkv, self.P = k.shape[1], pk.shape[-2]
        self.varlen = cu_seqlens is not None
        if self.varlen:
            if max_seqlen is None or int(max_seqlen) < 1:
                raise ValueError(f"a packed batch (cu_seqlens) needs max_seqlen >= 1, got {max_seqlen}")
            self.B, self.S = cu_seqlens.shape[0] - 1, int(max_seqlen)
            self.cu = _dense(cu_seqlens if cu_seqlens.dtype == torch.int64 else cu_seqlens.long())
        else:
            self.B, self.S, self.cu = q.shape[0], rows, None
        self.N = rows  # rows of a batch slice: S padded, the packed token count N
        mask = key_padding_mask
        if mask is not None:
            mask = _dense(mask if mask.dtype == torch.bool else mask != 0).view(torch.uint8)
        self.mask = mask
        self.pidx = None if prompt_index is None else _dense(
            prompt_index if prompt_index.dtype == torch.int64 else prompt_index.long())
        self.bias, self.bias_strides = None, (0, 0, 0)
        if attn_bias is not None:  # its own dtype when it is q's or float32 (read as float32 either way)
            bias = attn_bias if attn_bias.dtype in (q.dtype, torch.float32) else attn_bias.float()
            self.bias = _unit_last(bias).expand(self.B, self.H, self.S, self.S)  # broadcast dims get stride 0
            self.bias_strides = self.bias.stride()[:3]
        self.win_left, self.win_right, self.masked = token_window(causal, window)

    def rows(self, x: torch.Tensor) -> tuple:
        """Batch, head and row strides of a (B, heads, S, D) tensor; batch stride 0 when packed (one slice)."""
        s = x.stride()
        return (0 if self.varlen else s[0]), s[1], s[2]

    def pointers(self) -> tuple:
        """PIDX, MASK, CU, BIAS: absent ones replaced by q (never read: their switch is off)."""
        q = self.q
        return (q if self.pidx is None else self.pidx, q if self.mask is None else self.mask,
                q if self.cu is None else self.cu, q if self.bias is None else self.bias)

    def sizes(self) -> tuple:
        return self.H, self.S, self.P, self.D, self.N, self.H // self.Hkv, self.win_left, self.win_right

    def plan(self, kernels, dropout, bias_grad=False, overrides=()) -> _Plan:
        q = self.q
        return _plan(kernels, self.B, self.H, self.Hkv, self.S, self.P, self.D, self.T, q.dtype, dropout,
                     upcast(q.dtype), dot_precision(q.dtype), self.masked, self.bias is not None, bias_grad,
                     self.varlen, self.mask is not None, self.pidx is not None, q.device, overrides)


def seed_tensor(seed, device) -> torch.Tensor:
    """The dropout seed as the kernels load it: a 0-d int64 tensor on ``device`` (an int seed's 64 bits, signed;
    a tensor already there is used as it is, one elsewhere is copied there without a host read)."""
    if isinstance(seed, torch.Tensor):
        return seed if seed.device == device else seed.to(device, non_blocking=True)
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return torch.full((), seed - (1 << 64) if seed >= 1 << 63 else seed, dtype=torch.int64, device=device)


def forward(q, k, v, prefix_k, prefix_v, key_padding_mask=None, prompt_index=None, *, scale: float,
            dropout_p: float = 0.0, seed=None, causal: bool = False, window=(-1, -1), attn_bias=None,
            cu_seqlens=None, max_seqlen=None, config: LaunchConfig | None = None):
    """Launch the forward kernel. Returns ``(out, lse fp32)`` in q's layout: (B, H, S, D) and (B, H, S), or
    (1, H, N, D) and (1, H, N) packed (``cu_seqlens``, ``max_seqlen`` at least the longest sequence: a host int).
    ``seed`` (with dropout): a 0-d int64 tensor (on q's device: the kernel loads it) or an int. ``config``
    replaces :func:`config`'s launch parameters (the tuner's candidates).

    ``out`` has the memory layout of ``torch.empty(B, S, H, D).transpose(1, 2)``, so the caller's
    ``out.transpose(1, 2).reshape(B, S, H * D)`` is free.
    """
    op = _Operands(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, causal, window, attn_bias,
                   cu_seqlens, max_seqlen)
    dropout = dropout_p > 0
    plan = op.plan(("fwd",), dropout, overrides=_overrides({"fwd": config} if config is not None else None))
    q = op.q
    out = torch.empty((q.shape[0], q.shape[2], op.H, op.D), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if interpreting():  # poison: every element must be written by the kernel
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    seed = seed_tensor(seed, q.device) if dropout else q
    _fwd_kernel[plan.grids["fwd"]](
        q, op.k, op.v, op.pk, op.pv, *op.pointers(), seed, out, lse,
        *op.rows(q), *op.rows(op.k), *op.rows(op.v), *op.bias_strides,
        *op.sizes(), float(scale), float(dropout_p), **plan.consts["fwd"], **plan.opts["fwd"],
    )
    return out, lse


def backward(dout, q, k, v, prefix_k, prefix_v, out, lse, key_padding_mask=None, prompt_index=None, *,
             scale: float, dropout_p: float = 0.0, seed=None, causal: bool = False, window=(-1, -1),
             attn_bias=None, cu_seqlens=None, max_seqlen=None, bias_grad: bool = False, configs: dict | None = None):
    """Launch the two backward kernels (dQ, then dK/dV over the token and prefix key tiles). Returns ``(dq, dk,
    dv, dprefix_k, dprefix_v, dbias)``: dq/dk/dv with the strides of q/k/v (when those are dense), the prefix
    gradients in the prefix's shape and dtype, summed over the batch and the query heads of each key/value head
    (per prompt with ``prompt_index``), and with ``bias_grad`` the gradient of ``attn_bias`` in its shape and dtype
    (summed over its broadcast dimensions; None otherwise). ``configs``: ``{"bwd_dq": LaunchConfig, "bwd_dkdv":
    ...}`` replacing :func:`config`'s choices."""
    op = _Operands(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, causal, window, attn_bias,
                   cu_seqlens, max_seqlen)
    q, k, v = op.q, op.k, op.v
    dout, out = _unit_last(dout), _unit_last(out)
    dropout, has_bias = dropout_p > 0, op.bias is not None
    bias_grad = bias_grad and has_bias
    plan = op.plan(("bwd_dq", "bwd_dkdv"), dropout, bias_grad, _overrides(configs))
    B, H, S, P, D, T, Hkv = op.B, op.H, op.S, op.P, op.D, op.T, op.Hkv
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    # per batch chunk, the prefix programs' partial sums of dprefix_k and dprefix_v (every entry written)
    part = torch.empty((2, plan.n_chunks, T, Hkv, P, D), dtype=torch.float32, device=q.device)
    if interpreting():
        for x in (dq, dk, dv, delta, part):
            x.fill_(float("nan"))
    # zeros: the kernel writes only the (row, token) pairs some window lets the row see, within its sequence
    dbias = torch.zeros((B, H, S, S), dtype=torch.float32, device=q.device) if bias_grad else delta
    seed = seed_tensor(seed, q.device) if dropout else q
    pidx, mask, cu, bias = op.pointers()
    sizes = op.sizes()
    _bwd_dq_kernel[plan.grids["bwd_dq"]](
        q, k, v, op.pk, op.pv, pidx, mask, cu, bias, seed, out, dout, lse, delta, dq, dbias,
        *op.rows(q), *op.rows(k), *op.rows(v), *op.bias_strides, *op.rows(out), *op.rows(dout), *op.rows(dq),
        *sizes, float(scale), float(dropout_p), **plan.consts["bwd_dq"], **plan.opts["bwd_dq"],
    )
    _bwd_dkdv_kernel[plan.grids["bwd_dkdv"]](
        q, k, v, op.pk, op.pv, pidx, mask, cu, bias, seed, dout, lse, delta, dk, dv, part,
        *op.rows(q), *op.rows(k), *op.rows(v), *op.bias_strides, *op.rows(dout), *op.rows(dk), *op.rows(dv),
        *sizes, T, B, plan.n_chunks, plan.chunk, float(scale), float(dropout_p),
        **plan.consts["bwd_dkdv"], **plan.opts["bwd_dkdv"],
    )
    # the deterministic reduction of the partial sums (a fixed-order sum over the chunks, no atomics)
    dprefix = part.sum(1) if plan.n_chunks > 1 else part[:, 0]
    if dprefix.dtype != prefix_k.dtype:
        dprefix = dprefix.to(prefix_k.dtype)
    dpk, dpv = dprefix[0].view(prefix_k.shape), dprefix[1].view(prefix_v.shape)
    if bias_grad:
        dbias = dbias.sum_to_size(attn_bias.shape).to(attn_bias.dtype)
    return dq, dk, dv, dpk, dpv, dbias if bias_grad else None


# ------------------------------------------------------------------------------------------------
# ahead-of-time specialisations

# One representative (S, P) per bucket of config()'s heuristic: S <= 32 or not, P <= 16 or not.
_S_BUCKETS = (32, 64)
_P_BUCKETS = (16, 64)
# (VARLEN, HAS_MASK, HAS_PIDX): the batch layouts. Every one with every switch on (the most live registers);
# the other switch combinations in the usual padded layout (a padding mask, one prompt). They change only
# scalar and index loads.
LAYOUTS = ((False, True, False), (False, False, False), (False, False, True), (False, True, True),
           (True, False, False), (True, False, True))
_DEFAULT_LAYOUT = LAYOUTS[0]


def _feature_variants(kernel: str, ty: str) -> list[tuple[bool, bool, bool, str]]:
    """(masked, bias, bias_grad, bias pointer type) of every feature switch combination ``kernel`` takes: the
    token window (causal or sliding) on/off, no bias / a bias / a bias and its gradient, the bias in the input
    type or (for half inputs) in float32. The group size of grouped-query heads and the window's width are runtime
    values of the same code (``do_not_specialize``), so they add none. The last one has every switch on."""
    flags = _FLAGS[kernel]
    biases = [(False, False), (True, False)] + ([(True, True)] if "BIAS_GRAD" in flags else [])
    out = []
    for masked in (False, True):
        for bias, grad in biases:
            for bias_ty in ((ty, "fp32") if bias and ty != "fp32" else (ty,)):
                out.append((masked, bias, grad, bias_ty))
    return sorted(out, key=lambda f: (f[0], f[1], f[2], f[3] == ty))


def _layout_name(layout) -> str:
    varlen, mask, pidx = layout
    return ("_varlen" if varlen else "" if mask else "_nomask") + ("_pidx" if pidx else "")


def aot_specs(full: bool = False, candidates: dict | None = None) -> list[KernelSpec]:
    """The distinct specialisations the launchers compile on a GPU (``full``), or the CI subset.

    ``full`` enumerates :func:`config` over its whole domain: 3 kernels x dtype (fp16, bf16, fp32 with "ieee"
    and "tf32" dots) x dropout on/off x BLOCK_D (32, 64, 128) x the S and P buckets x the feature switches of
    :func:`_feature_variants` in the padded layout, plus every batch layout of :data:`LAYOUTS` with every switch
    on, deduplicated. The CI subset keeps what is most likely to fail: the largest tiles (S > 32, P > 16) with
    dropout on (the most live registers) for fp16 at BLOCK_D 64 and 128 (bf16 gets the same tiles) and for
    fp32-ieee at BLOCK_D 128, each with no switch, and with every switch on in the packed layout with a prompt
    index, plus the dropout-off BERT-base shape (S = 32, P = 16, D = 64) of the benchmark.

    ``candidates``: ``{(kernel, ShapeClass): [LaunchConfig, ...]}`` (e.g. from :func:`tune_space`): the
    specialisations of those launch parameters instead (every switch on, packed with a prompt index: the
    heaviest), named ``cand<i>_...``, for filtering a tuner's candidates by the AOT check."""
    if candidates is not None:
        return _candidate_specs(candidates)
    precisions = [(dt, "ieee") for dt in TRITON_TYPE] + [(torch.float32, "tf32")]
    if full:
        grid = [(dt, prec, drop, d, S, P, "full") for dt, prec in precisions for drop in (True, False)
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
                todo = [(variants[0], _DEFAULT_LAYOUT)]
            elif which == "all":
                todo = [(variants[-1], (True, False, True))]
            else:
                todo = [(f, _DEFAULT_LAYOUT) for f in variants] + [(variants[-1], lay) for lay in LAYOUTS[1:]]
            for (masked, bias, grad, bias_ty), layout in todo:
                spec = _spec(kernel, dt, prec, drop, d, S, P, masked, bias, grad, bias_ty, layout)
                if spec.name not in seen:
                    seen.add(spec.name)
                    specs.append(spec)
    return specs


def _spec(kernel, dt, prec, drop, d, S, P, masked, bias, grad, bias_ty, layout, cfg=None, prefix="") -> KernelSpec:
    ty = TRITON_TYPE[dt]
    varlen, has_mask, has_pidx = layout
    consts, opts = _constexprs(kernel, S, P, d, dt, drop, upcast=False, dot_prec=prec, masked=masked, bias=bias,
                               bias_grad=grad, varlen=varlen, has_mask=has_mask, has_pidx=has_pidx, cfg=cfg)
    tiles = "_".join(f"{k[6:].lower()}{v}" for k, v in consts.items() if k.startswith("BLOCK_"))
    switches = (("_drop" if drop else "") + ("_win" if masked else "")
                + (f"_bias{'32' if bias_ty != ty else ''}" if bias else "") + ("_dbias" if grad else ""))
    launch = f"_w{opts['num_warps']}s{opts['num_stages']}"
    name = f"{prefix}{kernel}_{ty}{'_tf32' if prec == 'tf32' else ''}_{tiles}{launch}{switches}{_layout_name(layout)}"
    sig = _signature(kernel, ty, bias_ty)
    return KernelSpec(name, _KERNEL_FNS[kernel], sig, consts, divisible_by_16=_aligned(sig), **opts)


def _candidate_specs(candidates: dict) -> list[KernelSpec]:
    dtypes = {"fp16": (torch.float16, "ieee"), "bf16": (torch.bfloat16, "ieee"), "fp32": (torch.float32, "ieee"),
              "tf32": (torch.float32, "tf32")}
    specs = []
    for (kernel, sc), cfgs in candidates.items():
        dt, prec = dtypes[sc.dtype]
        ty = TRITON_TYPE[dt]
        masked, bias, grad, bias_ty = _feature_variants(kernel, ty)[-1] if sc.switches else (False, False, False, ty)
        for i, cfg in enumerate(cfgs):
            specs.append(_spec(kernel, dt, prec, sc.dropout, sc.head_dim, sc.s_bucket, sc.p_bucket, masked, bias,
                               grad, bias_ty, (True, False, True), cfg=cfg, prefix=f"cand{i}_"))
    return specs


_KERNEL_FNS = {"fwd": _fwd_kernel, "bwd_dq": _bwd_dq_kernel, "bwd_dkdv": _bwd_dkdv_kernel}
check_interpreted(*_KERNEL_FNS.values())
_RUNTIME_TYPES = {"sm_scale": "fp32", "dropout_p": "fp32", "PIDX": "*i64", "CU": "*i64", "MASK": "*u8",
                  "SEED": "*i64", "LSE": "*fp32", "DELTA": "*fp32", "DPART": "*fp32", "DBIAS": "*fp32"}
_INTS = {"B", "H", "S", "P", "D", "N", "T"}


def _signature(kernel: str, ty: str, bias_ty: str | None = None) -> dict:
    """Triton types of the runtime arguments: tensors of the input dtype (the bias: ``bias_ty``), fp32
    statistics, i32 integers."""
    fn = _KERNEL_FNS[kernel]
    fn = fn.fn if hasattr(fn, "fn") else fn
    params = [n for n, prm in inspect.signature(fn).parameters.items() if "constexpr" not in str(prm.annotation)]
    types = dict(_RUNTIME_TYPES, BIAS=f"*{bias_ty or ty}")
    return {n: types.get(n, f"*{ty}" if n.isupper() and n not in _INTS else "i32") for n in params}


# runtime integers that are not multiples of 16 in the usual layouts: S-dependent strides (the bias), the sizes
# other than D, and the values the kernels do not specialise on (do_not_specialize)
_GENERIC = {"stride_biasb", "stride_biash", "stride_biasm"}


def _aligned(sig: dict) -> tuple:
    """Arguments Triton's launcher sees as 16-divisible for the usual layouts: 16-byte aligned storage, D a
    multiple of 16 and strides derived from it (zero batch strides of packed batches too). S-dependent
    arguments (the bias strides, lengths) stay generic. (The last-dim strides are 1 by construction and are not
    arguments.)"""
    return tuple(n for n, ty in sig.items()
                 if ty.startswith("*") or (n.startswith("stride_") and n not in _GENERIC) or n == "D")

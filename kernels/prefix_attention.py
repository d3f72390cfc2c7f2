"""Triton kernels of the fused prefix attention (``fastprompt.ops.prefix_attention``): a forward and three
backward kernels that attend to ``[prefix ; tokens]`` without materialising the concatenation, with their
launchers and ahead-of-time specs. No autograd here: ``fastprompt/ops/attention.py`` wraps them. How they
work: ``docs/ops/prefix_attention.md`` ("The Triton kernels in detail").
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from fastprompt.kernels._common import (
    LN2,
    LOG2E,
    TRITON_TYPE,
    LaunchConfig,
    check_device,
    check_interpreted,
    dot_precision,
    interpreting,
    upcast,
)
from fastprompt.kernels.aot import KernelSpec

# ------------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _keep(seed_lo, seed_hi, bh, rows, cols, n_cols, dropout_p):
    """Dropout keep-mask at (rows x cols) of the virtual concatenation (rows/cols broadcast)."""
    c0 = (rows * n_cols + cols).to(tl.uint32)
    c1 = (c0 * 0 + bh).to(tl.uint32)
    c2 = (c0 * 0 + seed_hi).to(tl.uint32)
    c3 = c0 * 0
    r, _, _, _ = tl.philox(seed_lo, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(r) >= dropout_p


@triton.jit
def _program_rows(H, S, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program of the grid (cdiv(S, BLOCK_M), B*H): its bh = b*H + h, b, h, row offsets and the
    row / head-dim bounds."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return bh, bh // H, bh % H, offs_m, offs_d, offs_d < D, offs_m < S


@triton.jit
def _load_rows(X, offs, offs_d, mask, stride_row, UPCAST: tl.constexpr):
    """(rows x BLOCK_D) tile of X at row offsets ``offs`` (unit last stride); zeros where masked."""
    x = tl.load(X + offs[:, None] * stride_row + offs_d[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _prefix_kv(PK, PV, PIDX, stride_pidx, stride_pkt, stride_pkh, stride_pvt, stride_pvh, b, h):
    """Base pointers of example b's prompt (its ``prompt_index`` row) at head h."""
    t = tl.load(PIDX + b * stride_pidx)
    return PK + t * stride_pkt + h * stride_pkh, PV + t * stride_pvt + h * stride_pvh


@triton.jit
def _token_keys(MASK, stride_mb, b, start, S, BLOCK_N: tl.constexpr):
    """Token key rows start..start+BLOCK_N of example b: offsets, in-bounds, and visible (not padding)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < S
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
def _fwd_tile(acc, m_i, l_i, q, kv_k, kv_v, offs_n, offs_d, d_ok, valid, cols, offs_m, stride_k, stride_v,
              qk_scale, n_cols, dropout_p, seed_lo, seed_hi, bh,
              DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    _, v, s = _kv_scores(q, kv_k, kv_v, offs_n, offs_d, d_ok, valid, stride_k, stride_v, qk_scale, UPCAST, DOT_PREC)
    s = tl.where(valid[None, :], s, float("-inf"))
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


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _fwd_kernel(
    Q, K, V, PK, PV, PIDX, MASK, O, LSE,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_pkt, stride_pkh, stride_pkp, stride_pvt, stride_pvh, stride_pvp,
    stride_pidx, stride_mb, stride_ob, stride_oh, stride_os,
    H, S, P, D, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh, b, h, offs_m, offs_d, d_ok, m_ok = _program_rows(H, S, D, BLOCK_M, BLOCK_D)
    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, m_ok[:, None] & d_ok[None, :], stride_qs,
                   UPCAST)
    qk_scale = sm_scale * LOG2E
    n_cols = P + S
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    pk, pv = _prefix_kv(PK, PV, PIDX, stride_pidx, stride_pkt, stride_pkh, stride_pvt, stride_pvh, b, h)
    for start in range(0, P, BLOCK_P):
        offs_n = start + tl.arange(0, BLOCK_P)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, pk, pv, offs_n, offs_d, d_ok, offs_n < P, offs_n, offs_m,
                                  stride_pkp, stride_pvp, qk_scale, n_cols, dropout_p, seed_lo, seed_hi, bh,
                                  DROPOUT, UPCAST, DOT_PREC)
    kb = K + b * stride_kb + h * stride_kh
    vb = V + b * stride_vb + h * stride_vh
    for start in range(0, S, BLOCK_N):
        offs_n, _, valid = _token_keys(MASK, stride_mb, b, start, S, BLOCK_N)
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, kb, vb, offs_n, offs_d, d_ok, valid, P + offs_n, offs_m,
                                  stride_ks, stride_vs, qk_scale, n_cols, dropout_p, seed_lo, seed_hi, bh,
                                  DROPOUT, UPCAST, DOT_PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if DROPOUT:
        out = out * (1.0 / (1.0 - dropout_p))
    lse = tl.where(l_i == 0.0, float("-inf"), m_i * LN2 + tl.log(l_safe))
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + bh * S + offs_m, lse, mask=m_ok)


# ------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, kv_k, kv_v, offs_n, offs_d, d_ok, valid, cols, offs_m, stride_k, stride_v,
             qk_scale, n_cols, dropout_p, seed_lo, seed_hi, bh,
             DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr):
    k, v, s = _kv_scores(q, kv_k, kv_v, offs_n, offs_d, d_ok, valid, stride_k, stride_v, qk_scale, UPCAST, DOT_PREC)
    p = tl.where(valid[None, :], tl.exp2(s - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
    if DROPOUT:
        keep = _keep(seed_lo, seed_hi, bh, offs_m[:, None], cols[None, :], n_cols, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _bwd_dq_kernel(
    Q, K, V, PK, PV, PIDX, MASK, O, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_pkt, stride_pkh, stride_pkp, stride_pvt, stride_pvh, stride_pvp,
    stride_pidx, stride_mb, stride_ob, stride_oh, stride_os, stride_dob, stride_doh, stride_dos,
    stride_dqb, stride_dqh, stride_dqs,
    H, S, P, D, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh, b, h, offs_m, offs_d, d_ok, m_ok = _program_rows(H, S, D, BLOCK_M, BLOCK_D)
    md = m_ok[:, None] & d_ok[None, :]
    q = _load_rows(Q + b * stride_qb + h * stride_qh, offs_m, offs_d, md, stride_qs, False)
    do = _load_rows(DO + b * stride_dob + h * stride_doh, offs_m, offs_d, md, stride_dos, False)
    o = _load_rows(O + b * stride_ob + h * stride_oh, offs_m, offs_d, md, stride_os, False)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + bh * S + offs_m, delta, mask=m_ok)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(LSE + bh * S + offs_m, mask=m_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # empty rows: p = 0
    qk_scale = sm_scale * LOG2E
    n_cols = P + S
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    pk, pv = _prefix_kv(PK, PV, PIDX, stride_pidx, stride_pkt, stride_pkh, stride_pvt, stride_pvh, b, h)
    for start in range(0, P, BLOCK_P):
        offs_n = start + tl.arange(0, BLOCK_P)
        dq = _dq_tile(dq, q, do, lse2, delta, pk, pv, offs_n, offs_d, d_ok, offs_n < P, offs_n, offs_m,
                      stride_pkp, stride_pvp, qk_scale, n_cols, dropout_p, seed_lo, seed_hi, bh,
                      DROPOUT, UPCAST, DOT_PREC)
    kb = K + b * stride_kb + h * stride_kh
    vb = V + b * stride_vb + h * stride_vh
    for start in range(0, S, BLOCK_N):
        offs_n, _, valid = _token_keys(MASK, stride_mb, b, start, S, BLOCK_N)
        dq = _dq_tile(dq, q, do, lse2, delta, kb, vb, offs_n, offs_d, d_ok, valid, P + offs_n, offs_m,
                      stride_ks, stride_vs, qk_scale, n_cols, dropout_p, seed_lo, seed_hi, bh,
                      DROPOUT, UPCAST, DOT_PREC)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqs + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=md)


@triton.jit
def _kv_tile_grads(dk, dv, k, v, valid, cols, Q, DO, LSE, DELTA, b, h, bh, offs_d, d_ok,
                   stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos,
                   S, qk_scale, n_cols, dropout_p, seed_lo, seed_hi,
                   DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr):
    """Accumulate dK, dV of one key/value tile over every query row of example b, head h (transposed form)."""
    qb = Q + b * stride_qb + h * stride_qh
    dob = DO + b * stride_dob + h * stride_doh
    for start_m in range(0, S, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < S
        md = m_ok[:, None] & d_ok[None, :]
        q = _load_rows(qb, offs_m, offs_d, md, stride_qs, UPCAST)
        do = _load_rows(dob, offs_m, offs_d, md, stride_dos, UPCAST)
        lse = tl.load(LSE + bh * S + offs_m, mask=m_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(DELTA + bh * S + offs_m, mask=m_ok, other=0.0)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * qk_scale  # (keys, queries)
        p_t = tl.where(valid[:, None], tl.exp2(s_t - lse2[None, :]), 0.0)
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


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _bwd_dkdv_kernel(
    Q, K, V, MASK, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_mb, stride_dob, stride_doh, stride_dos,
    stride_dkb, stride_dkh, stride_dks, stride_dvb, stride_dvh, stride_dvs,
    H, S, P, D, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n, n_ok, valid = _token_keys(MASK, stride_mb, b, tl.program_id(0) * BLOCK_N, S, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    nd = n_ok[:, None] & d_ok[None, :]
    k = _load_rows(K + b * stride_kb + h * stride_kh, offs_n, offs_d, nd, stride_ks, UPCAST)
    v = _load_rows(V + b * stride_vb + h * stride_vh, offs_n, offs_d, nd, stride_vs, UPCAST)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dk, dv = _kv_tile_grads(dk, dv, k, v, valid, P + offs_n, Q, DO, LSE, DELTA, b, h, bh, offs_d, d_ok,
                            stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos,
                            S, sm_scale * LOG2E, P + S, dropout_p, seed_lo, seed_hi,
                            DROPOUT, UPCAST, DOT_PREC, BLOCK_M)
    tl.store(DK + b * stride_dkb + h * stride_dkh + offs_n[:, None] * stride_dks + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=nd)
    tl.store(DV + b * stride_dvb + h * stride_dvh + offs_n[:, None] * stride_dvs + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=nd)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi"])
def _bwd_prefix_kernel(
    Q, PK, PV, ORDER, SEG, DO, LSE, DELTA, DPK, DPV,
    stride_qb, stride_qh, stride_qs, stride_pkt, stride_pkh, stride_pkp, stride_pvt, stride_pvh, stride_pvp,
    stride_dob, stride_doh, stride_dos,
    H, S, P, D, T, batch_chunk, sm_scale, dropout_p, seed_lo, seed_hi,
    DROPOUT: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # ORDER lists the examples grouped by prompt (stable), SEG[t]:SEG[t+1] is prompt t's segment of it.
    # Program (t, h, prefix tile) x g walks the part of t's segment that lies in the g-th batch chunk.
    n_pblocks = tl.cdiv(P, BLOCK_P)
    pid = tl.program_id(0)
    g = tl.program_id(1)
    t = pid // (H * n_pblocks)
    h = (pid // n_pblocks) % H
    offs_n = (pid % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    n_ok = offs_n < P
    nd = n_ok[:, None] & d_ok[None, :]
    k = _load_rows(PK + t * stride_pkt + h * stride_pkh, offs_n, offs_d, nd, stride_pkp, UPCAST)
    v = _load_rows(PV + t * stride_pvt + h * stride_pvh, offs_n, offs_d, nd, stride_pvp, UPCAST)
    dk = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    lo = tl.maximum(tl.load(SEG + t), g * batch_chunk)
    hi = tl.minimum(tl.load(SEG + t + 1), (g + 1) * batch_chunk)
    for j in range(lo, hi):
        b = tl.load(ORDER + j)
        dk, dv = _kv_tile_grads(dk, dv, k, v, n_ok, offs_n, Q, DO, LSE, DELTA, b, h, b * H + h, offs_d, d_ok,
                                stride_qb, stride_qh, stride_qs, stride_dob, stride_doh, stride_dos,
                                S, sm_scale * LOG2E, P + S, dropout_p, seed_lo, seed_hi,
                                DROPOUT, UPCAST, DOT_PREC, BLOCK_M)
    out = (((g * T + t) * H + h) * P + offs_n[:, None]) * D + offs_d[None, :]  # (G, T, H, P, D) fp32
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


def config(kernel: str, S: int, P: int, D: int, dtype: torch.dtype, dropout: bool) -> LaunchConfig:
    """The tiles each kernel is launched with (chosen, with ``LaunchConfig.maxnreg``, so that no specialisation
    spills on sm_80/sm_90: see ``aot_specs`` and the AOT test). Short sequences (S <= 32, BERT-style
    sentences) get 32-row tiles."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    bd = max(32, triton.next_power_of_2(D))
    warps = 8 if bd == 128 else 4

    def launch(M, N, Pt, num_warps, num_stages=2, maxnreg=255):
        tiles = dict(BLOCK_M=M, BLOCK_N=N, BLOCK_P=Pt, BLOCK_D=bd)
        return LaunchConfig({k: tiles[k] for k in _TILES[kernel]}, num_warps, num_stages, maxnreg)

    if dtype == torch.float32:
        # Exact fp32 dots run on FMA units with whole operand rows in registers: 16-row tiles keep every
        # fp32 kernel spill-free (32-row tiles spill at D = 128, and erratically at D = 64); ptxas spills
        # a few registers of the prefix-gradient kernel at D = 64 with dropout unless it is not pipelined.
        # ptxas is erratic here: at D = 128 the dropout kernels and dK/dV spill with a 255-register bound and
        # not without one; the others need the bound (measured per specialisation by the AOT check).
        return launch(16, 16, 16, 4, num_stages=1 if kernel == "bwd_prefix" else 2,
                      maxnreg=None if (bd == 128 and (dropout or kernel == "bwd_dkdv")) else 255)
    big = 32 if S <= 32 else 64
    bp = 16 if P <= 16 else 32
    if kernel == "fwd":
        bn = 32 if dropout else big
        return launch(big, bn, 16 if P <= 16 else bn, 4)
    if kernel == "bwd_dq":
        return launch(big, 32, bp, warps)
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
    """(H, P, D) or (T, H, P, D) -> a (T, H, P, D) view with unit last stride."""
    if prefix.stride(-1) != 1:
        prefix = prefix.contiguous()
    if prefix.dim() == 3:
        prefix = prefix.unsqueeze(0)
    return prefix


def _last_dim_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _operands(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index):
    """The launchers' common arguments: unit last strides, (T, H, P, D) prefix views, the mask as bytes (all
    ones with a zero stride when None) and the prompt index (0 with a zero stride when None)."""
    check_device(q)
    q, k, v = (_last_dim_unit(x) for x in (q, k, v))
    pk, pv = _prefix_views(prefix_k), _prefix_views(prefix_v)
    B, H, S, D = q.shape
    if key_padding_mask is None:
        mask, stride_mb = torch.ones(max(S, 1), dtype=torch.uint8, device=q.device), 0
    else:
        mask = key_padding_mask.contiguous().view(torch.uint8)
        stride_mb = mask.stride(0)
    if prompt_index is None:
        pidx, stride_pidx = torch.zeros(1, dtype=torch.int64, device=q.device), 0
    else:
        pidx, stride_pidx = prompt_index, prompt_index.stride(0)
    return q, k, v, pk, pv, mask, stride_mb, pidx, stride_pidx


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


def _constexprs(kernel: str, S: int, P: int, D: int, dtype: torch.dtype, dropout: bool, upcast: bool,
                dot_prec: str):
    """Compile-time arguments and launch options of ``kernel`` (shared with :func:`aot_specs`)."""
    cfg = config(kernel, S, P, D, dtype, dropout)
    return dict(DROPOUT=dropout, UPCAST=upcast, DOT_PREC=dot_prec, **cfg.tiles), cfg.options()


def forward(q, k, v, prefix_k, prefix_v, key_padding_mask=None, prompt_index=None, *, scale: float,
            dropout_p: float = 0.0, seed: int = 0):
    """Launch the forward kernel. Returns ``(out (B, H, S, D), lse (B, H, S) fp32)``.

    ``out`` has the memory layout of ``torch.empty(B, S, H, D).transpose(1, 2)``, so the caller's
    ``out.transpose(1, 2).reshape(B, S, H * D)`` is free.
    """
    q, k, v, pk, pv, mask, stride_mb, pidx, stride_pidx = _operands(q, k, v, prefix_k, prefix_v, key_padding_mask,
                                                                     prompt_index)
    B, H, S, D = q.shape
    T, _, P, _ = pk.shape
    out = torch.empty((B, S, H, D), dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    if interpreting():  # poison: every element must be written by the kernel
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    consts, opts = _constexprs("fwd", S, P, D, q.dtype, dropout_p > 0, upcast(q.dtype), dot_precision(q.dtype))
    lo, hi = _seed_words(seed)
    _fwd_kernel[(triton.cdiv(S, consts["BLOCK_M"]), B * H)](
        q, k, v, pk, pv, pidx, mask, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        pk.stride(0) if T > 1 else 0, pk.stride(1), pk.stride(2),
        pv.stride(0) if T > 1 else 0, pv.stride(1), pv.stride(2),
        stride_pidx, stride_mb, out.stride(0), out.stride(1), out.stride(2),
        H, S, P, D, float(scale), float(dropout_p), lo, hi, **consts, **opts,
    )
    return out, lse


def backward(dout, q, k, v, prefix_k, prefix_v, out, lse, key_padding_mask=None, prompt_index=None, *,
             scale: float, dropout_p: float = 0.0, seed: int = 0):
    """Launch the three backward kernels. Returns ``(dq, dk, dv, dprefix_k, dprefix_v)``: dq/dk/dv with the
    strides of q/k/v (when those are dense), the prefix gradients with the prefix's shape and dtype, summed
    over the batch (per prompt with ``prompt_index``)."""
    q, k, v, pk, pv, mask, stride_mb, pidx, stride_pidx = _operands(q, k, v, prefix_k, prefix_v, key_padding_mask,
                                                                     prompt_index)
    dout, out = _last_dim_unit(dout), _last_dim_unit(out)
    B, H, S, D = q.shape
    T, _, P, _ = pk.shape
    dropout, up, prec = dropout_p > 0, upcast(q.dtype), dot_precision(q.dtype)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    delta = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    if interpreting():
        for x in (dq, dk, dv, delta):
            x.fill_(float("nan"))
    lo, hi = _seed_words(seed)
    spkt = pk.stride(0) if T > 1 else 0
    spvt = pv.stride(0) if T > 1 else 0
    consts, opts = _constexprs("bwd_dq", S, P, D, q.dtype, dropout, up, prec)
    _bwd_dq_kernel[(triton.cdiv(S, consts["BLOCK_M"]), B * H)](
        q, k, v, pk, pv, pidx, mask, out, dout, lse, delta, dq,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        spkt, pk.stride(1), pk.stride(2), spvt, pv.stride(1), pv.stride(2),
        stride_pidx, stride_mb, out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2), dq.stride(0), dq.stride(1), dq.stride(2),
        H, S, P, D, float(scale), float(dropout_p), lo, hi, **consts, **opts,
    )
    consts, opts = _constexprs("bwd_dkdv", S, P, D, q.dtype, dropout, up, prec)
    _bwd_dkdv_kernel[(triton.cdiv(S, consts["BLOCK_N"]), B * H)](
        q, k, v, mask, dout, lse, delta, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), stride_mb,
        dout.stride(0), dout.stride(1), dout.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        H, S, P, D, float(scale), float(dropout_p), lo, hi, **consts, **opts,
    )
    consts, opts = _constexprs("bwd_prefix", S, P, D, q.dtype, dropout, up, prec)
    n_pblocks = triton.cdiv(P, consts["BLOCK_P"])
    chunk = triton.cdiv(B, batch_chunks(B, max(1, T * H * n_pblocks), q.device))
    chunks = triton.cdiv(B, chunk)
    dpk_part = torch.zeros((chunks, T, H, P, D), dtype=torch.float32, device=q.device)
    dpv_part = torch.zeros_like(dpk_part)
    if P > 0:
        order, seg = _prompt_segments(prompt_index, B, T, q.device)
        _bwd_prefix_kernel[(T * H * n_pblocks, chunks)](
            q, pk, pv, order, seg, dout, lse, delta, dpk_part, dpv_part,
            q.stride(0), q.stride(1), q.stride(2),
            spkt, pk.stride(1), pk.stride(2), spvt, pv.stride(1), pv.stride(2),
            dout.stride(0), dout.stride(1), dout.stride(2),
            H, S, P, D, T, chunk, float(scale), float(dropout_p), lo, hi, **consts, **opts,
        )
    # Deterministic reduction of the per-chunk partial sums (a fixed-order torch reduction, no atomics).
    dpk = dpk_part.sum(0).to(prefix_k.dtype).reshape(prefix_k.shape)
    dpv = dpv_part.sum(0).to(prefix_v.dtype).reshape(prefix_v.shape)
    return dq, dk, dv, dpk, dpv


# ------------------------------------------------------------------------------------------------
# ahead-of-time specialisations

# One representative (S, P) per bucket of config(): S <= 32 or not, P <= 16 or not.
_S_BUCKETS = (32, 64)
_P_BUCKETS = (16, 64)


def aot_specs(full: bool = False) -> list[KernelSpec]:
    """The distinct specialisations the launchers compile on a GPU (``full``), or the CI subset.

    ``full`` enumerates :func:`config` over its whole domain: 4 kernels x dtype (fp16, bf16, fp32 with "ieee"
    and "tf32" dots) x dropout on/off x BLOCK_D (32, 64, 128) x the S and P buckets, deduplicated (180
    kernels). The CI subset keeps what is most likely to fail: the largest tiles (S > 32, P > 16) with
    dropout on (the most live registers) for fp16 at BLOCK_D 64 and 128 (bf16 gets the same tiles) and for
    fp32-ieee at BLOCK_D 128, plus the dropout-off BERT-base shape (S = 32, P = 16, D = 64) of the benchmark.
    """
    precisions = [(dt, "ieee") for dt in TRITON_TYPE] + [(torch.float32, "tf32")]
    if full:
        grid = [(dt, prec, drop, d, S, P) for dt, prec in precisions for drop in (True, False) for d in (32, 64, 128)
                for S in _S_BUCKETS for P in _P_BUCKETS]
    else:
        grid = [(torch.float16, "ieee", True, 64, 64, 64), (torch.float16, "ieee", True, 128, 64, 64),
                (torch.float32, "ieee", True, 128, 64, 64), (torch.float16, "ieee", False, 64, 32, 16)]
    specs, seen = [], set()
    for dt, prec, drop, d, S, P in grid:
        for kernel in KERNELS:
            consts, opts = _constexprs(kernel, S, P, d, dt, drop, upcast=False, dot_prec=prec)
            key = (kernel, TRITON_TYPE[dt], tuple(sorted(consts.items())), tuple(sorted(opts.items())))
            if key in seen:
                continue
            seen.add(key)
            tiles = "_".join(f"{k[6:].lower()}{v}" for k, v in consts.items() if k.startswith("BLOCK_"))
            ty = TRITON_TYPE[dt] + ("_tf32" if prec == "tf32" else "")
            name = f"{kernel}_{ty}_{tiles}{'_drop' if drop else ''}"
            sig = _signature(kernel, TRITON_TYPE[dt])
            specs.append(KernelSpec(name, _KERNEL_FNS[kernel], sig, consts, divisible_by_16=_aligned(sig), **opts))
    return specs


_KERNEL_FNS = {"fwd": _fwd_kernel, "bwd_dq": _bwd_dq_kernel, "bwd_dkdv": _bwd_dkdv_kernel,
               "bwd_prefix": _bwd_prefix_kernel}
check_interpreted(*_KERNEL_FNS.values())
_RUNTIME_TYPES = {"sm_scale": "fp32", "dropout_p": "fp32", "PIDX": "*i64", "ORDER": "*i32", "SEG": "*i32",
                  "MASK": "*u8", "LSE": "*fp32", "DELTA": "*fp32", "DPK": "*fp32", "DPV": "*fp32"}


def _signature(kernel: str, ty: str) -> dict:
    """Triton types of the runtime arguments: tensors of the input dtype, fp32 statistics, i32 integers."""
    fn = _KERNEL_FNS[kernel].fn if hasattr(_KERNEL_FNS[kernel], "fn") else _KERNEL_FNS[kernel]
    import inspect

    params = [n for n, prm in inspect.signature(fn).parameters.items()
              if "constexpr" not in str(prm.annotation)]
    ints = {"B", "H", "S", "P", "D", "T"}
    return {n: _RUNTIME_TYPES.get(n, f"*{ty}" if n.isupper() and n not in ints else "i32") for n in params}


def _aligned(sig: dict) -> tuple:
    """Arguments Triton's launcher sees as 16-divisible for the usual layouts: 16-byte aligned storage, D a
    multiple of 16 and strides derived from it. S-dependent arguments (mask stride, lengths) stay generic.
    (The last-dim strides are 1 by construction and are not arguments.)"""
    generic = {"stride_mb", "stride_pidx"}
    return tuple(n for n, ty in sig.items()
                 if ty.startswith("*") or (n.startswith("stride_") and n not in generic) or n == "D")

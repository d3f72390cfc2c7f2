"""Fused in-batch cosine InfoNCE with O(N·d) memory: k negatives per anchor, hardness weighting, false-negative
masks, the symmetric loss, Matryoshka dimensions and PromCSE's energy-based hinge.

``contrastive_loss(z1, z2, z3)`` scores every anchor ``z1[i]`` against every column of ``cat(z2, z3[0], ...,
z3[k-1])`` by cosine similarity and returns the cross-entropy of its positive ``z2[positive_offset + i]``. The
kernels never materialise the N x M similarity matrix: they stream column tiles with an online log-sum-exp and a
running max/argmax for the hardest negative, or store a bounded row chunk of it at a time. The definitions (every
option, with its paper or library): :func:`contrastive_loss` and ``docs/ops/contrastive_loss.md``.

How the work is split: this module validates the arguments, turns a call into one or two *problems* (rows against
column segments: the anchors against the positives and negatives, and for the symmetric loss the positives
against the anchors), computes what every backend shares (the inverse norms of each Matryoshka prefix, GISTEmbed's
thresholds, the targets' text ids) and, from the kernels' per-row statistics, the row losses and the per-row
coefficients of the backward. The kernels (the C++ ones of ``fastprompt._C``, the Triton ones of
:mod:`fastprompt.kernels.contrastive_loss` with the stripe path of :mod:`fastprompt.kernels.contrastive_chunked`)
compute statistics, and gradients in raw space that :func:`_finish` turns into the gradients of the unnormalised
embeddings. When the gradient is needed and the reduction is mean/sum (the loss is the last op: a uniform upstream
gradient) the forward computes the gradients too, from the same tiles (for the unit upstream gradient; the backward
only rescales them): on the CPU unless symmetric, on the Triton backends always (3 products per tile, from stored row
chunks of the similarity matrix, where one row tile's chunk fits the budget).

Backends: ``"triton"`` (the fused Triton kernels; CUDA, on CPU tensors the Triton interpreter), ``"chunked"`` (cuBLAS
products with a Triton epilogue; same conditions), ``"cpu"`` (the C++ kernels, CPU tensors only), ``"reference"``
(plain PyTorch, :func:`fastprompt.ops.reference.contrastive_loss_reference`) and ``"auto"``, resolved by the rule
shared by every op (:func:`fastprompt.backends.resolve_backend`; this op declares :data:`SUPPORT`); on CUDA ``auto``
takes one of the two Triton variants (:func:`fastprompt.kernels.contrastive_chunked.choose_variant`: the GPU's
tuned table, else a heuristic). The host path of the Triton backends reads no device tensor (value checks are
``torch._assert_async`` on the device; constant tables are cached). The triton/chunked/cpu kernels are one
``torch.library`` custom op with a ``backend`` argument (``fastprompt::contrastive_loss_fwd`` + ``_bwd``, with fake
implementations and a registered autograd formula; the wiring every fused op shares, ``docs/adding-a-kernel.md``),
so ``torch.compile`` sees a single opaque node.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fastprompt.backends import OpSupport, register_op, resolve_backend
from fastprompt.choices import HARDNESS_MODES, MARGIN_STRATEGIES, PARTITION_MODES, REDUCTIONS, check_choice
from fastprompt.constants import COSINE_EPS
from fastprompt.host_sync import checks_stay_on_device
from fastprompt.ops import _cpp
from fastprompt.ops.reference import contrastive_loss_reference, fn_threshold, hardness_coefficients
from fastprompt.ops.types import ContrastiveStats, Guide

__all__ = ["contrastive_loss", "ContrastiveStats", "Guide", "SUPPORT"]

#: What the backends take (the rule that chooses among them: :func:`fastprompt.backends.resolve_backend`).
SUPPORT = register_op(OpSupport(
    name="contrastive_loss",
    triton_dtypes=(torch.float16, torch.bfloat16, torch.float32),
    native="the C++ kernel of fastprompt._C",
    native_devices=("cpu",),
    native_missing=_cpp.missing_reason,
    triton_variants=("chunked",),
))


# ------------------------------------------------------------------------------------------------
# validation


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _check_matrix(name, z, like, rows=None, dim=None):
    """A floating (rows, dim) tensor on ``like``'s device (and of its dtype unless ``dim`` is given: a guide)."""
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(z).__name__}")
    if z.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, dim), got shape {tuple(z.shape)}")
    if not z.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {z.dtype}")
    if z.device != like.device or (dim is None and z.dtype != like.dtype):
        raise ValueError(f"{name} is {z.dtype} on {z.device} but z1 is {like.dtype} on {like.device}")
    want = like.shape[1] if dim is None else dim
    if z.shape[1] != want:
        raise ValueError(f"{name} has dim {z.shape[1]} but {'z1' if dim is None else 'the guide'} has dim {want}")
    if rows is not None and z.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got {z.shape[0]}")


def _negatives(name, z3, m2, like, dim=None):
    """z3 as the (k, M2, dim) negatives block (None when absent or k = 0)."""
    if z3 is None:
        return None
    if not isinstance(z3, torch.Tensor) or z3.dim() not in (2, 3):
        raise ValueError(f"{name} must be (M2, dim) or (k, M2, dim) hard negatives, got "
                         f"{tuple(z3.shape) if isinstance(z3, torch.Tensor) else type(z3).__name__}")
    block = z3 if z3.dim() == 3 else z3.unsqueeze(0)
    if block.shape[1] != m2:
        raise ValueError(f"{name} must have as many rows per negative as z2 ({m2}): got shape {tuple(z3.shape)}")
    _check_matrix(name, block.reshape(-1, block.shape[-1]), like, dim=dim)
    return block if block.shape[0] > 0 else None


def _check_ids(name, ids, length, like):
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int64 tensor of text ids, got "
                         f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if ids.shape[0] != length:
        raise ValueError(f"{name} must hold one id per column ({length}), got {ids.shape[0]}")
    if ids.device != like.device:
        raise ValueError(f"{name} is on {ids.device} but z1 is on {like.device}")


def _validate(z1, z2, z3, a):
    """Check every argument; returns the negatives block (k, M2, d) or None. ``a``: the keyword arguments."""
    _check_matrix("z1", z1, z1)
    _check_matrix("z2", z2, z1)
    n, m2 = z1.shape[0], z2.shape[0]
    if n == 0 or z1.shape[1] == 0:
        raise ValueError(f"z1 must have at least one row and one column, got shape {tuple(z1.shape)}")
    neg = _negatives("z3", z3, m2, z1)
    k = 0 if neg is None else neg.shape[0]
    offset = a["positive_offset"]
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"positive_offset must be an int, got {offset!r}")
    if m2 < n:
        raise ValueError(f"z2 needs at least as many rows as z1 (each anchor needs a positive): {m2} < {n}")
    if not 0 <= offset <= m2 - n:
        raise ValueError(
            f"positive_offset={offset} out of range: the positives z2[offset:offset+{n}] must lie in "
            f"the {m2} rows of z2 (0 <= offset <= {m2 - n})"
        )
    if m2 * (1 + k) < 2:
        raise ValueError(
            "an in-batch contrastive loss needs at least 2 columns (a positive and a negative); got N=1 "
            "anchor, 1 positive and no hard negative"
        )
    for name in ("temperature", "hard_negative_weight", "hinge_margin", "hinge_weight", "hardness_strength"):
        if not _is_number(a[name]):
            raise ValueError(f"{name} must be a finite number, got {a[name]!r}")
    if a["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0, got {a['temperature']}")
    if a["hinge_weight"] < 0:
        raise ValueError(f"hinge_weight must be >= 0, got {a['hinge_weight']}")
    check_choice("reduction", a["reduction"], REDUCTIONS)
    check_choice("partition_mode", a["partition_mode"], PARTITION_MODES)
    if a["hardness_mode"] is not None:
        check_choice("hardness_mode", a["hardness_mode"], HARDNESS_MODES)
    if a["hardness_strength"] < 0:
        raise ValueError(f"hardness_strength must be >= 0, got {a['hardness_strength']}")
    symmetric, rev = a["symmetric"], a["reverse_columns"]
    if rev is not None:
        if not symmetric:
            raise ValueError("reverse_columns are the columns of the symmetric loss's reverse term: set symmetric=True")
        _check_matrix("reverse_columns", rev, z1)
        if rev.shape[0] < offset + n:
            raise ValueError(f"reverse_columns must hold the local anchors at rows positive_offset..+{n}: "
                             f"{rev.shape[0]} rows < {offset + n}")
    m_rev = (z1 if rev is None else rev).shape[0]
    if symmetric and m_rev < 2:
        raise ValueError("symmetric=True needs at least 2 anchors (the reverse term has the anchors as its columns)")
    ids, anchor_ids = a["column_ids"], a["anchor_ids"]
    if ids is not None:
        _check_ids("column_ids", ids, m2 * (1 + k), z1)
        if symmetric and anchor_ids is None:
            raise ValueError("symmetric=True with column_ids needs anchor_ids too (the text ids of the reverse term's "
                             "columns, the anchors), or the reverse term would keep its false negatives")
    if anchor_ids is not None:
        if not symmetric or ids is None:
            raise ValueError("anchor_ids mask the symmetric loss's reverse term: they need symmetric=True and "
                             "column_ids")
        _check_ids("anchor_ids", anchor_ids, m_rev, z1)
    margin, guide = a["fn_margin"], a["guide"]
    if margin is not None and not _is_number(margin):
        raise ValueError(f"fn_margin must be a finite number or None, got {margin!r}")
    check_choice("fn_margin_strategy", a["fn_margin_strategy"], MARGIN_STRATEGIES)
    if guide is not None:
        if margin is None:
            raise ValueError("a guide scores the fn_margin false-negative mask: set fn_margin (GISTEmbed: 0.0)")
        _validate_guide(guide, z1, m2, neg, rev if symmetric else None)
    dims, weights = a["matryoshka_dims"], a["matryoshka_weights"]
    if dims is not None:
        dims = list(dims)
        if not dims or any(isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= z1.shape[1] for t in dims):
            raise ValueError(f"matryoshka_dims must be a non-empty list of ints in [1, {z1.shape[1]}], got {dims}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"matryoshka_dims must be distinct, got {dims}")
        if weights is not None and (len(list(weights)) != len(dims) or not all(_is_number(w) for w in weights)):
            raise ValueError(f"matryoshka_weights must be {len(dims)} finite numbers, got {weights}")
    elif weights is not None:
        raise ValueError("matryoshka_weights need matryoshka_dims")
    return neg


def _check_values(z1, z2, z3, rev, ids, offset):
    """NaN/Inf inputs and negative positive ids: a ValueError on CPU tensors; on the GPU (or wherever
    :func:`fastprompt.host_sync.checks_stay_on_device` says so) a device-side assertion (``torch._assert_async``),
    which waits for nothing: a failure surfaces as a CUDA error at the next synchronisation."""
    n = z1.shape[0]
    checks = [(torch.isfinite(z).all(), f"{name} contains NaN or Inf values")
              for name, z in (("z1", z1), ("z2", z2), ("z3", z3), ("reverse_columns", rev)) if z is not None]
    if ids is not None:
        checks.append(((ids[offset:offset + n] >= 0).all(),
                       "column_ids of the positives must be >= 0 (a negative id marks a column without text)"))
    on_device = checks_stay_on_device(z1, ids)
    for ok, message in checks:
        if on_device:
            torch._assert_async(ok, message)
        elif not bool(ok):  # host read: CPU tensors only (checks_stay_on_device is False)
            raise ValueError(message)


def _validate_guide(guide, z1, m2, neg, rev):
    if not isinstance(guide, (tuple, list)) or not 2 <= len(guide) <= 4:
        raise ValueError("guide must be a Guide(z1, z2, z3=None, reverse_columns=None) of guide embeddings")
    g = Guide(*guide)
    if not isinstance(g.z1, torch.Tensor) or g.z1.dim() != 2:
        raise ValueError("guide.z1 must be a 2-D (N, guide dim) tensor")
    dg = g.z1.shape[1]
    _check_matrix("guide.z1", g.z1, z1, rows=z1.shape[0], dim=dg)
    _check_matrix("guide.z2", g.z2, z1, rows=m2, dim=dg)
    if (g.z3 is None) != (neg is None):
        raise ValueError("the guide needs negatives (guide.z3) exactly when the op has them (z3)")
    if neg is not None:
        gneg = _negatives("guide.z3", g.z3, m2, z1, dim=dg)
        if gneg is None or gneg.shape[0] != neg.shape[0]:
            raise ValueError(f"guide.z3 must hold as many negatives per row as z3 ({neg.shape[0]})")
    if (g.reverse_columns is None) != (rev is None):
        raise ValueError("the guide needs reverse_columns exactly when the op has them")
    if rev is not None:
        _check_matrix("guide.reverse_columns", g.reverse_columns, z1, rows=rev.shape[0], dim=dg)


# ------------------------------------------------------------------------------------------------
# problems: what the kernels of every backend take


class _Cfg(NamedTuple):
    """The scalar options of one call, as the torch.library op carries them (dims ascending, weights alike)."""

    dims: list
    weights: list
    temperature: float
    hard_negative_weight: float
    a_in: float
    a_own: float
    fn_margin: Optional[float]
    relative_margin: bool
    hinge_margin: float
    hinge_weight: float
    symmetric: bool
    joint: bool
    positive_offset: int
    backend: str


@dataclass
class _Problem:
    """Rows against one or two column segments (targets block, then the negatives block), in the arguments' order
    of the kernels' ``stats`` / ``grads`` (csrc/contrastive_loss.cpp describes them)."""

    x: torch.Tensor  # (n, d) rows
    rx: torch.Tensor  # (D, n) inverse norms of the prefixes
    cols: list  # the segments, (m_s, d) each
    rcols: list  # (D, m_s) each
    dims: list  # ascending
    tid: Optional[torch.Tensor]  # (n,) text id of each row's target
    col_ids: list  # (m_s,) each, or None
    gx: Optional[torch.Tensor]  # (n, dg) unit guide vectors of the rows
    gcols: list  # (m_s, dg) each, or None
    thr: Optional[torch.Tensor]  # (D, n) model-scored / (1, n) guide-scored false-negative thresholds
    label_offset: int
    inv_tau: float
    bias_own: float = 0.0
    a_in: float = 0.0
    a_own: float = 0.0

    def args(self) -> tuple:
        return (self.x, self.rx, self.cols, self.rcols, self.dims, self.tid, self.col_ids, self.gx, self.gcols,
                self.thr, self.label_offset, self.inv_tau, self.bias_own, self.a_in, self.a_own)


def _compute_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _inv_norms(z: torch.Tensor, dims, dtype) -> torch.Tensor:
    """(D, rows): 1 / max(||z[:, :d_t]||, eps) per prefix, in ``dtype`` (no copy of z)."""
    return torch.stack([torch.linalg.vector_norm(z[:, :t], dim=1, dtype=dtype).clamp_min_(COSINE_EPS).reciprocal_()
                        for t in dims])


def _unit(g: Optional[torch.Tensor], dtype) -> Optional[torch.Tensor]:
    return None if g is None else F.normalize(g.to(_compute_dtype(g.dtype)), dim=-1, eps=COSINE_EPS).to(dtype)


def _problems(z1, z2, z3, rev, column_ids, anchor_ids, guide, cfg: _Cfg, be: str):
    """The anchors' problem and, when symmetric, the reverse one (positives against the anchors), with the inputs
    every backend shares. The C++ kernels take the compute dtype (float32 / float64), Triton the input dtype (its
    norms and thresholds in float32)."""
    cdt = _compute_dtype(z1.dtype)
    kdt = cdt if be == "cpu" else z1.dtype  # the embeddings as the kernels read them
    sdt = cdt if be == "cpu" else torch.float32  # norms, thresholds
    n, d = z1.shape
    m2, off = z2.shape[0], cfg.positive_offset
    dims = cfg.dims
    neg = None if z3 is None else z3.reshape(-1, d)
    x, c0 = z1.to(kdt).contiguous(), z2.to(kdt).contiguous()
    c1 = None if neg is None else neg.to(kdt).contiguous()
    r1, r2 = _inv_norms(z1, dims, sdt), _inv_norms(z2, dims, sdt)
    r3 = None if neg is None else _inv_norms(neg, dims, sdt)
    thr, gx, gcols, g1u, g2u, grevu = None, None, [None] * (1 if neg is None else 2), None, None, None
    if cfg.fn_margin is not None:
        if guide is not None:
            g1u, g2u = _unit(guide[0], kdt), _unit(guide[1], kdt)
            g3u = None if neg is None else _unit(guide[2].reshape(-1, guide[2].shape[-1]), kdt)
            grevu = _unit(guide[3], kdt) if len(guide) > 3 else None
            pos_score = (g1u.to(sdt) * g2u[off:off + n].to(sdt)).sum(1)[None]  # (1, n)
            gx, gcols = g1u, [g2u] + ([] if neg is None else [g3u])
        else:  # scored by the model's own cosines, per prefix
            prod = z1.to(sdt) * z2[off:off + n].to(sdt)
            pos_score = torch.stack([prod[:, :t].sum(1) for t in dims]) * r1 * r2[:, off:off + n]
        thr = fn_threshold(pos_score, cfg.fn_margin, "relative" if cfg.relative_margin else "absolute")
    tid = col_ids = None
    if column_ids is not None:
        tid = column_ids[off:off + n].contiguous()
        col_ids = [column_ids[:m2]] + ([] if neg is None else [column_ids[m2:]])
    q2d = _Problem(x, r1, [c0] + ([] if c1 is None else [c1]), [r2] + ([] if r3 is None else [r3]), dims, tid,
                   col_ids or [None] * (1 if c1 is None else 2), gx, gcols, thr, off, 1.0 / cfg.temperature,
                   cfg.hard_negative_weight, cfg.a_in, cfg.a_own)
    if not cfg.symmetric:
        return q2d, None
    # the reverse term: rows are the positives z2[off:off+n], columns the anchors (z1, target i; or the gathered
    # reverse columns, target off + i), with the anchors' ids and the same thresholds
    roff = 0 if rev is None else off
    rc = x if rev is None else rev.to(kdt).contiguous()
    rr = r1 if rev is None else _inv_norms(rev, dims, sdt)
    rtid = None if anchor_ids is None else anchor_ids[roff:roff + n].contiguous()
    rgx = None if g2u is None else g2u[off:off + n].contiguous()
    rgcol = None if g1u is None else (g1u if grevu is None else grevu)
    reverse = _Problem(c0[off:off + n], r2[:, off:off + n].contiguous(), [rc], [rr], dims, rtid, [anchor_ids], rgx,
                       [rgcol], thr, roff, 1.0 / cfg.temperature)
    return q2d, reverse


def _finish(e: torch.Tensor, q: torch.Tensor, z: torch.Tensor, r: torch.Tensor, dims) -> torch.Tensor:
    """The gradient of the unnormalised rows from the kernels' raw-space sums (csrc/contrastive_loss.cpp):
    dz = E - Σ_t (r^t)² Q^t z[:, :d_t], the projection of each prefix's normalisation (none for a prefix whose norm
    is below eps, which is only scaled), in place in E."""
    coef = (q * r.square() * (r < 1.0 / COSINE_EPS)).to(e.dtype)
    for t, dim in enumerate(dims):  # (z in its own dtype: addcmul_ promotes into e, without an fp32 copy of z)
        e[:, :dim].addcmul_(z[:, :dim], coef[t][:, None], value=-1.0)
    return e


# ------------------------------------------------------------------------------------------------
# the backends' kernels, behind one interface


def _stats(be, prob: _Problem, track_hard: bool):
    """(lse, pos, hard, hidx), (D, n) each: hard / hidx are NaN / -1 unless track_hard."""
    if be == "cpu":
        return torch.ops.fastprompt.contrastive_cpu_stats(*prob.args(), track_hard)
    if be == "chunked":
        from fastprompt.kernels import contrastive_chunked as tc

        return tc.stripe(*prob.args(), variant="chunked", track_hard=track_hard)[0]
    from fastprompt.kernels import contrastive_loss as tk

    return tk.stats(*prob.args(), track_hard)


def _stripe_fits(be, prob: Optional[_Problem]) -> bool:
    """Whether a problem takes the stripe path (the gradient from stored row chunks of its similarity matrix, 3
    products): always on the chunked backend; on the Triton backend when one row tile's stripe fits the budget
    (else the streaming kernels)."""
    if prob is None or be == "chunked":
        return True
    from fastprompt.kernels import contrastive_chunked as tc

    n, d = prob.x.shape
    return tc.chunk_rows(n, sum(c.shape[0] for c in prob.cols), d, len(prob.dims), prob.x.dtype, prob.x.device,
                         "triton") > 0


def _stripe_grads(be, prob: _Problem, cfg: _Cfg, gw, forward: bool, extra, track_hard, stats_in=None):
    """(stats, (E_rows, Q_rows, E_cols, Q_cols)) of a problem by the stripe path, for the per-row upstream weight
    ``gw`` (a number: uniform; or (n,)); ``forward``: the anchors' problem (its hinge, its target numerator), else
    the symmetric loss's reverse one; ``extra``: the other problem's log-sum-exp (joint partition)."""
    from fastprompt.kernels import contrastive_chunked as tc

    half = 0.5 if cfg.symmetric and not cfg.joint else 1.0
    weights = _weights(cfg, torch.float32, prob.x.device)
    coef = tc.Coefficients(gw, weights, half / cfg.temperature, cfg.hinge_weight if forward else 0.0,
                           cfg.hinge_margin, forward or not cfg.joint, extra if cfg.joint else None)
    return tc.stripe(*prob.args(), variant="chunked" if be == "chunked" else "triton", track_hard=track_hard,
                     coef=coef, stats_in=stats_in)


def _grads(be, prob: _Problem, coefficients):
    """(E_rows, Q_rows, E_cols, Q_cols) for dS = cce exp(logit - L) - cdiag [target] + chg [hardest]."""
    if be == "cpu":
        return torch.ops.fastprompt.contrastive_cpu_grads(*prob.args(), *coefficients)
    from fastprompt.kernels import contrastive_loss as tk

    return tk.grads(*prob.args(), *coefficients)


def _weights(cfg: _Cfg, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The Matryoshka weights as a (D,) tensor: on the C++ backend a host tensor, else a cached device table (no
    host-to-device copy per call)."""
    if cfg.backend == "cpu":
        return torch.tensor(cfg.weights, dtype=dtype)
    from fastprompt.kernels.contrastive_loss import device_table

    return device_table(cfg.weights, dtype, device)


def _row_losses(cfg: _Cfg, st, rst):
    """Per-row losses Σ_t w_t (ce_t + hinge_weight hinge_t) from the statistics (D, n)."""
    lse, pos, hard = st[0], st[1], st[2]
    inv_tau = 1.0 / cfg.temperature
    if cfg.symmetric and cfg.joint:
        ce = torch.logaddexp(lse, rst[0]) - pos * inv_tau
    elif cfg.symmetric:
        ce = 0.5 * (lse - pos * inv_tau + rst[0] - rst[1] * inv_tau)
    else:
        ce = lse - pos * inv_tau
    if cfg.hinge_weight != 0.0:
        ce = ce + cfg.hinge_weight * (cfg.hinge_margin + hard - pos).clamp_min(0)
    return (_weights(cfg, ce.dtype, ce.device)[:, None] * ce).sum(0)


def _coefficients(cfg: _Cfg, grad_rows, st, rst):
    """The per-row coefficients of dS (L, cce, cdiag, chg, hidx), (D, n) each, for the anchors' problem and the
    reverse one (None unless symmetric), for the upstream gradient of each row's loss."""
    lse, pos, hard, hidx = st
    gw = grad_rows.to(lse.dtype)[None, :] * _weights(cfg, lse.dtype, lse.device)[:, None]  # (D, n)
    half = 0.5 if cfg.symmetric and not cfg.joint else 1.0
    cce = gw * (half / cfg.temperature)
    if cfg.hinge_weight != 0.0:
        chg = gw * cfg.hinge_weight * (cfg.hinge_margin + hard - pos > 0)
    else:
        chg = torch.zeros_like(cce)
    L = torch.logaddexp(lse, rst[0]) if cfg.symmetric and cfg.joint else lse
    q2d = (L.contiguous(), cce, cce + chg, chg, hidx)
    if not cfg.symmetric:
        return q2d, None
    # the reverse term's own target logit only in per_direction (joint: the numerator is the anchors' term's)
    rev = (L.contiguous() if cfg.joint else rst[0], cce, torch.zeros_like(cce) if cfg.joint else cce,
           torch.zeros_like(cce), torch.full_like(hidx, -1))
    return q2d, rev


# ------------------------------------------------------------------------------------------------
# the torch.library op: forward returns per-row losses + statistics, backward recomputes the tiles


def _stripe_fits_shapes(z1, z2, neg, rev, symmetric: bool, ndims: int) -> bool:
    """Whether both problems of a call fit the Triton stripe path (one row tile's stripe within the budget)."""
    from fastprompt.kernels import contrastive_chunked as tc

    n, d = z1.shape
    m = z2.shape[0] * (1 + (0 if neg is None else neg.shape[0]))
    fits = tc.chunk_rows(n, m, d, ndims, z1.dtype, z1.device, "triton") > 0
    if symmetric:
        m_rev = (z1 if rev is None else rev).shape[0]
        fits = fits and tc.chunk_rows(n, m_rev, d, ndims, z1.dtype, z1.device, "triton") > 0
    return fits


def _mean_weight(n: int, dtype: torch.dtype) -> float:
    """1/n rounded as MeanBackward rounds it in ``dtype``, so that loss.backward() rescales by exactly 1."""
    return float(np.float32(1.0) / np.float32(n)) if dtype == torch.float32 else 1.0 / n


def _empty(z):
    return z.new_empty((0, z.shape[-1]))


def _split_cols(ecol, z2, z3):
    """dz2, dz3 from the gradient of all the columns (separate tensors: the op's outputs must not alias)."""
    m2 = z2.shape[0]
    return ecol[:m2], (None if z3 is None else ecol[m2:].reshape(z3.shape).clone())


def _kernel_fwd(z1, z2, z3, rev, column_ids, anchor_ids, guide, cfg: _Cfg, track_hard, grad_weight):
    """(rows, lse, lse_sym, pos, pos_rev, hard, hidx) (D, n) stats, plus (dz1, dz2, dz3, drev) when the CPU's
    fused pass computed the gradients for the uniform per-row upstream gradient ``grad_weight`` (else None)."""
    be = cfg.backend
    q2d, reverse = _problems(z1, z2, z3, rev, column_ids, anchor_ids, guide, cfg, be)
    grads = None
    rst = None
    if grad_weight > 0 and be != "cpu":  # Triton / chunked: the gradient from stored stripes, 3 products
        if cfg.joint:  # one softmax over both problems: the reverse normaliser first
            rst = _stats(be, reverse, False)
        st, g = _stripe_grads(be, q2d, cfg, grad_weight, True, rst[0] if cfg.joint else None, track_hard)
        rg = None
        if reverse is not None:
            rst_own, rg = _stripe_grads(be, reverse, cfg, grad_weight, False, st[0], False)
            rst = rst if cfg.joint else rst_own
        grads = _assemble(z1, z2, z3, rev, q2d, reverse, g, rg, cfg)
    elif grad_weight > 0:  # CPU, not symmetric: forward and backward from the same stripes
        w = [grad_weight * wt for wt in cfg.weights]
        out = torch.ops.fastprompt.contrastive_cpu_fused(
            *q2d.args(), [wt / cfg.temperature for wt in w], [wt * cfg.hinge_weight for wt in w], cfg.hinge_margin,
            track_hard)
        st, (ex, qx, ecol, qcol) = out[:4], out[4:]
        d1 = _finish(ex, qx, z1, q2d.rx, cfg.dims).to(z1.dtype)
        neg = None if z3 is None else z3.reshape(-1, z1.shape[1])
        r_cols = q2d.rcols[0] if neg is None else torch.cat(q2d.rcols, 1)
        ecol = _finish(ecol, qcol, z2 if neg is None else torch.cat([z2, neg]), r_cols, cfg.dims).to(z1.dtype)
        grads = (d1, *_split_cols(ecol, z2, z3), None)
    else:
        st = _stats(be, q2d, track_hard)
    if rst is None and reverse is not None:
        rst = _stats(be, reverse, False)
    rows = _row_losses(cfg, st, rst)
    lse, pos, hard, hidx = st
    none = lambda: lse.new_empty((lse.shape[0], 0))  # noqa: E731  (distinct: outputs must not alias)
    return (rows, lse, rst[0] if rst else none(), pos, rst[1] if rst else none(), hard, hidx), grads


def _kernel_bwd(grad_rows, z1, z2, z3, rev, column_ids, anchor_ids, guide, stats, cfg: _Cfg):
    """(dz1, dz2, dz3, drev) for the per-row upstream gradient ``grad_rows`` (dz3 / drev None when absent)."""
    be = cfg.backend
    lse, lse_sym, pos, hard, hidx = stats
    q2d, reverse = _problems(z1, z2, z3, rev, column_ids, anchor_ids, guide, cfg, be)
    st = (lse, pos, hard, hidx)
    if be != "cpu" and _stripe_fits(be, q2d) and _stripe_fits(be, reverse):
        gw = grad_rows.to(torch.float32)
        _, g = _stripe_grads(be, q2d, cfg, gw, True, lse_sym, False, stats_in=st)
        rg = None
        if reverse is not None:  # its dS needs only its normaliser (no hinge, no hardest negative)
            rst = (lse_sym, torch.zeros_like(lse_sym), torch.full_like(lse_sym, float("-inf")),
                   torch.full_like(hidx, -1))
            _, rg = _stripe_grads(be, reverse, cfg, gw, False, lse, False, stats_in=rst)
        return _assemble(z1, z2, z3, rev, q2d, reverse, g, rg, cfg)
    rst = (lse_sym, None) if cfg.symmetric else None
    co, rco = _coefficients(cfg, grad_rows, st, rst)
    g = _grads(be, q2d, co)
    rg = _grads(be, reverse, rco) if reverse is not None else None
    return _assemble(z1, z2, z3, rev, q2d, reverse, g, rg, cfg)


def _assemble(z1, z2, z3, rev, q2d: _Problem, reverse: Optional[_Problem], g, rg, cfg: _Cfg):
    """(dz1, dz2, dz3, drev) in the inputs' dtypes from the raw-space sums (E_rows, Q_rows, E_cols, Q_cols) of the
    anchors' problem ``g`` and of the reverse one ``rg`` (rows: the positives z2[off:off+n]; columns: z1 or the
    reverse columns); dz3 / drev None when absent."""
    ex, qx, ecol, qcol = g
    neg = None if z3 is None else z3.reshape(-1, z1.shape[1])
    cols = z2 if neg is None else torch.cat([z2, neg])
    d1 = _finish(ex, qx, z1, q2d.rx, cfg.dims)
    dcols = _finish(ecol, qcol, cols, torch.cat(q2d.rcols, 1), cfg.dims)
    drev = None
    if reverse is not None:
        ex, qx, ecol, qcol = rg
        off, n = cfg.positive_offset, z1.shape[0]
        dcols[off:off + n] += _finish(ex, qx, z2[off:off + n], reverse.rx, cfg.dims)
        dr = _finish(ecol, qcol, z1 if rev is None else rev, reverse.rcols[0], cfg.dims)
        if rev is None:
            d1 += dr
        else:
            drev = dr.to(rev.dtype)
    d2, d3 = _split_cols(dcols.to(z1.dtype), z2, z3)
    return d1.to(z1.dtype), d2, d3, drev


def _guide(g1, g2, g3, grev):
    return None if g1 is None else (g1, g2, g3, grev)


_STATS_OUT = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _no_autocast(z):
    """The kernels compute in float32 (float64) whatever an enclosing autocast region asks: the loss stays float32
    (closer to the float32 loss than a bf16 / fp16 one), and the host-side products do not drop to half."""
    return torch.autocast(z.device.type, enabled=False)


@torch.library.custom_op("fastprompt::contrastive_loss_fwd", mutates_args=())
def _op_fwd(z1: torch.Tensor, z2: torch.Tensor, z3: Optional[torch.Tensor], reverse_columns: Optional[torch.Tensor],
            column_ids: Optional[torch.Tensor], anchor_ids: Optional[torch.Tensor], g1: Optional[torch.Tensor],
            g2: Optional[torch.Tensor], g3: Optional[torch.Tensor], grev: Optional[torch.Tensor], dims: list[int],
            weights: list[float], temperature: float, hard_negative_weight: float, a_in: float, a_own: float,
            fn_margin: Optional[float], relative_margin: bool, hinge_margin: float, hinge_weight: float,
            symmetric: bool, joint: bool, positive_offset: int, backend: str, track_hardest: bool,
            grad_weight: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_loss, lse, lse_sym, pos_sim, pos_rev, hard_sim, hard_idx, dz1, dz2, dz3, drev); the statistics are
    (D, n) for the ascending dims (lse_sym / pos_rev (D, 0) unless symmetric); the hardest-negative outputs are
    NaN / -1 unless track_hardest (always tracked when hinge_weight != 0); dz* are the gradients for the uniform
    per-row upstream gradient ``grad_weight`` when it is > 0 (the CPU's fused forward+backward), else empty."""
    cfg = _Cfg(dims, weights, temperature, hard_negative_weight, a_in, a_own, fn_margin, relative_margin,
               hinge_margin, hinge_weight, symmetric, joint, positive_offset, backend)
    with _no_autocast(z1):
        stats, grads = _kernel_fwd(z1, z2, z3, reverse_columns, column_ids, anchor_ids, _guide(g1, g2, g3, grev),
                                   cfg, track_hardest or hinge_weight != 0.0, grad_weight)
    if grads is None:
        grads = (_empty(z1), _empty(z1), _empty(z1), _empty(z1))  # distinct: outputs must not alias
    else:
        grads = tuple(g if g is not None else _empty(z1) for g in grads)
    return stats + grads


@_op_fwd.register_fake
def _op_fwd_fake(z1, z2, z3, reverse_columns, column_ids, anchor_ids, g1, g2, g3, grev, dims, weights, temperature,
                 hard_negative_weight, a_in, a_own, fn_margin, relative_margin, hinge_margin, hinge_weight, symmetric,
                 joint, positive_offset, backend, track_hardest, grad_weight):
    n, cdt = z1.shape[0], _compute_dtype(z1.dtype)
    sdt = cdt if backend == "cpu" else torch.float32
    nd = len(dims)
    stat = lambda k: z1.new_empty((nd, k), dtype=sdt)  # noqa: E731
    grads = (_empty(z1), _empty(z1), _empty(z1), _empty(z1))
    if grad_weight > 0:
        grads = (torch.empty_like(z1), torch.empty_like(z2), torch.empty_like(z3) if z3 is not None else _empty(z1),
                 torch.empty_like(reverse_columns) if reverse_columns is not None else _empty(z1))
    return (z1.new_empty((n,), dtype=sdt), stat(n), stat(n if symmetric else 0), stat(n), stat(n if symmetric else 0),
            stat(n), z1.new_empty((nd, n), dtype=torch.int64)) + grads


@torch.library.custom_op("fastprompt::contrastive_loss_bwd", mutates_args=())
def _op_bwd(grad: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor, z3: Optional[torch.Tensor],
            reverse_columns: Optional[torch.Tensor], column_ids: Optional[torch.Tensor],
            anchor_ids: Optional[torch.Tensor], g1: Optional[torch.Tensor], g2: Optional[torch.Tensor],
            g3: Optional[torch.Tensor], grev: Optional[torch.Tensor], lse: torch.Tensor, lse_sym: torch.Tensor,
            pos_sim: torch.Tensor, hard_sim: torch.Tensor, hard_idx: torch.Tensor, dims: list[int],
            weights: list[float], temperature: float, hard_negative_weight: float, a_in: float, a_own: float,
            fn_margin: Optional[float], relative_margin: bool, hinge_margin: float, hinge_weight: float,
            symmetric: bool, joint: bool, positive_offset: int, backend: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz1, dz2, dz3, drev); dz3 / drev are empty tensors when z3 / reverse_columns are None."""
    cfg = _Cfg(dims, weights, temperature, hard_negative_weight, a_in, a_own, fn_margin, relative_margin,
               hinge_margin, hinge_weight, symmetric, joint, positive_offset, backend)
    with _no_autocast(z1):
        d1, d2, d3, dr = _kernel_bwd(grad, z1, z2, z3, reverse_columns, column_ids, anchor_ids,
                                     _guide(g1, g2, g3, grev), (lse, lse_sym, pos_sim, hard_sim, hard_idx), cfg)
    return d1, d2, (d3 if d3 is not None else _empty(z1)), (dr if dr is not None else _empty(z1))


@_op_bwd.register_fake
def _op_bwd_fake(grad, z1, z2, z3, reverse_columns, *args):
    return (torch.empty_like(z1), torch.empty_like(z2), torch.empty_like(z3) if z3 is not None else _empty(z1),
            torch.empty_like(reverse_columns) if reverse_columns is not None else _empty(z1))


_N_TENSORS = 10  # z1, z2, z3, reverse_columns, column_ids, anchor_ids, g1, g2, g3, grev


def _setup_context(ctx, inputs, output):
    tensors, params = inputs[:_N_TENSORS], inputs[_N_TENSORS:]
    _, lse, lse_sym, pos, _, hard, hidx, g1, g2, g3, gr = output
    ctx.grad_weight = params[-1]
    ctx.backend = params[-3]
    ctx.n_inputs = len(inputs)
    ctx.present = (tensors[2] is not None, tensors[3] is not None)  # z3, reverse_columns
    ctx.mark_non_differentiable(*output[1:])
    if ctx.grad_weight > 0:  # the forward already computed the gradients (for a uniform upstream gradient)
        ctx.save_for_backward(g1, g2, g3 if ctx.present[0] else None, gr if ctx.present[1] else None)
    else:
        ctx.save_for_backward(*tensors, lse, lse_sym, pos, hard, hidx)
        ctx.params = params[:-2]  # all but track_hardest and grad_weight, in the order _op_bwd takes them


def _backward(ctx, grad_rows, *unused):
    if ctx.grad_weight > 0:
        # rows.mean()/.sum() of the wrapper make grad_rows uniform: rescale the precomputed gradients
        grads = ctx.saved_tensors
        factor = grad_rows[0] / ctx.grad_weight if grad_rows is not None else 0.0
        # the C++ backend (host tensors) skips the copy of the usual loss.backward() (factor 1); elsewhere reading
        # the factor would wait for the GPU. (Eager only: tracing sees fake / functional tensors, no data to test.)
        host = ctx.backend == "cpu" and type(grad_rows) is torch.Tensor and not torch.compiler.is_compiling()
        if not (host and float(factor) == 1.0):  # host read: the C++ backend's CPU tensors only
            grads = tuple(None if g is None else g * factor.to(g.dtype) for g in grads)
        return tuple(grads) + (None,) * (ctx.n_inputs - 4)
    saved = ctx.saved_tensors
    tensors, stats = saved[:_N_TENSORS], saved[_N_TENSORS:]
    if grad_rows is None:
        grad_rows = stats[0].new_zeros(stats[0].shape[1])
    d1, d2, d3, dr = _op_bwd(grad_rows.contiguous(), *tensors, *stats, *ctx.params)
    return (d1, d2, d3 if ctx.present[0] else None, dr if ctx.present[1] else None) + (None,) * (ctx.n_inputs - 4)


_op_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------
# public API


def contrastive_loss(
    z1: torch.Tensor,
    z2: torch.Tensor,
    z3: Optional[torch.Tensor] = None,
    *,
    temperature: float = 0.05,
    hard_negative_weight: float = 0.0,
    hinge_margin: float = 0.2,
    hinge_weight: float = 0.0,
    symmetric: bool = False,
    partition_mode: str = "per_direction",
    reverse_columns: Optional[torch.Tensor] = None,
    hardness_mode: Optional[str] = None,
    hardness_strength: float = 0.0,
    column_ids: Optional[torch.Tensor] = None,
    anchor_ids: Optional[torch.Tensor] = None,
    fn_margin: Optional[float] = None,
    fn_margin_strategy: str = "absolute",
    guide: Optional[Guide] = None,
    matryoshka_dims: Optional[Sequence[int]] = None,
    matryoshka_weights: Optional[Sequence[float]] = None,
    reduction: str = "mean",
    return_stats: bool = False,
    positive_offset: int = 0,
    backend: str = "auto",
    check_finite: bool = True,
):
    """Cosine InfoNCE of each anchor against ``cat(z2, z3[0], ..., z3[k-1])``, with every option of the embedding
    losses people train with, fused (O(N·d) memory). The math: ``docs/ops/contrastive_loss.md``.

    Args:
        z1: (N, d) anchors.
        z2: (M2, d) positives / in-batch columns, M2 >= N; the positive of ``z1[i]`` is ``z2[positive_offset + i]``
            (M2 > N when z2 was all-gathered across processes, with ``positive_offset = rank * N``, or when the
            anchors are a chunk of the batch).
        z3: hard negatives, extra columns: (M2, d) (one per row) or (k, M2, d) (k per row, ``z3[j, r]`` the j-th
            negative of row r; sentence-transformers' column order). Every anchor is scored against all of them
            (its own and every other row's).
        temperature: logits are cosine / temperature (sentence-transformers' ``scale`` = 1 / temperature).
        hard_negative_weight: added to the logit of each anchor's own negatives ``z3[j, positive_offset + i]`` (the
            log of SimCSE's weight).
        hinge_margin, hinge_weight: PromCSE's L_EH = relu(margin + cos(z1_i, hardest negative) - cos(z1_i,
            positive)), added with this weight (PromCSE uses margin 0.2, weight 10; 0 disables it).
        symmetric: add the reverse term: each positive ``z2[p(i)]`` against the anchors (the columns of
            ``reverse_columns``, default z1), target anchor i.
        partition_mode: with ``symmetric``: "per_direction" (the two cross-entropies averaged) or "joint" (one
            softmax over both blocks), as sentence-transformers' MultipleNegativesRankingLoss.
        reverse_columns: the reverse term's columns when they are more than the local anchors (all-gathered, or
            the anchors of the whole batch when z1 is a chunk): (M', d) holding z1 at rows
            ``positive_offset..positive_offset+N``.
        hardness_mode, hardness_strength: sentence-transformers' hardness weighting: ``strength * stop_grad(cos)``
            added to the logits of "in_batch_negatives" (every column but the anchor's own positive and
            negatives), "hard_negatives" (its own negatives) or "all_negatives" (every column but its positive).
        column_ids: (M2 * (1 + k),) int64 text ids of the columns (cat order): a column with the id of the anchor's
            positive is a false negative, left out of the softmax; a negative id marks a column without text
            (padding), left out of every row's. anchor_ids: the reverse term's columns' ids (needed with symmetric).
        fn_margin, fn_margin_strategy: GISTEmbed's mask: a column scoring above the positive's score minus
            ``fn_margin`` ("absolute") or minus ``|score| * fn_margin`` ("relative") is left out; scored by the
            ``guide``'s cosines when given, else by the model's own (per Matryoshka dimension).
        guide: :class:`Guide` embeddings of a guide model (no gradient), for ``fn_margin``.
        matryoshka_dims, matryoshka_weights: the loss summed over the re-normalised d_t-prefixes of every
            embedding, weighted (default 1 each), in one pass that shares the products of the prefixes.
        reduction: "mean" | "sum" | "none" (per-anchor losses).
        return_stats: also return a :class:`ContrastiveStats`.
        positive_offset: row of z2 holding the positive of z1[0].
        backend: "auto" (CUDA -> one of the Triton variants, CPU -> C++ if built, else the reference with a
            one-time warning), "triton" (the fused kernels; CPU tensors run in the Triton interpreter), "chunked"
            (cuBLAS products and a Triton epilogue, the same conditions), "cpu", "reference"; see
            :func:`fastprompt.backends.resolve_backend`.
        check_finite: raise ValueError on NaN/Inf inputs and negative positive ids (one pass over the inputs;
            skipped under torch.compile). On CUDA a device-side assertion instead (``torch._assert_async``: no wait
            for the GPU; a failure surfaces as a CUDA error at the next synchronisation).

    Returns the loss (float32, or float64 for float64 inputs), or ``(loss, stats)`` with ``return_stats``.
    Gradients flow to z1, z2, z3 and reverse_columns.
    """
    args = dict(temperature=temperature, hard_negative_weight=hard_negative_weight, hinge_margin=hinge_margin,
                hinge_weight=hinge_weight, symmetric=symmetric, partition_mode=partition_mode,
                reverse_columns=reverse_columns, hardness_mode=hardness_mode, hardness_strength=hardness_strength,
                column_ids=column_ids, anchor_ids=anchor_ids, fn_margin=fn_margin,
                fn_margin_strategy=fn_margin_strategy, guide=guide, matryoshka_dims=matryoshka_dims,
                matryoshka_weights=matryoshka_weights, reduction=reduction, positive_offset=positive_offset,
                check_finite=check_finite)
    neg = _validate(z1, z2, z3, args)
    if neg is None:
        z3 = None
    symmetric = bool(symmetric)
    guide = None if guide is None else Guide(*guide)
    if guide is not None and neg is None:
        guide = guide._replace(z3=None)
    be = resolve_backend(SUPPORT, z1, backend)
    if backend == "auto" and be == "triton":  # on CUDA: the fused kernels or the chunked cuBLAS variant
        from fastprompt.kernels import contrastive_chunked as tc

        grad = torch.is_grad_enabled() and any(z is not None and z.requires_grad for z in (z1, z2, z3))
        be = tc.choose_variant(z1.dtype, z1.shape[0], z2.shape[0] * (1 + (0 if neg is None else neg.shape[0])),
                               z1.shape[1], grad, z1.device)
    if check_finite and not torch.compiler.is_compiling():
        _check_values(z1, z2, z3, reverse_columns if symmetric else None, column_ids, positive_offset)
    if be == "reference":
        kw = {k: v for k, v in args.items() if k != "check_finite"}
        return contrastive_loss_reference(z1, z2, z3, return_stats=return_stats, **kw)
    user_dims = list(matryoshka_dims) if matryoshka_dims is not None else [z1.shape[1]]
    user_weights = [float(w) for w in matryoshka_weights] if matryoshka_weights is not None else [1.0] * len(user_dims)
    order = sorted(range(len(user_dims)), key=user_dims.__getitem__)  # the kernels take the prefixes ascending
    a_in, a_own = hardness_coefficients(hardness_mode, float(hardness_strength))
    cfg = _Cfg([user_dims[i] for i in order], [user_weights[i] for i in order], float(temperature),
               float(hard_negative_weight), a_in, a_own, None if fn_margin is None else float(fn_margin),
               fn_margin_strategy == "relative", float(hinge_margin), float(hinge_weight), symmetric,
               partition_mode == "joint", int(positive_offset), be)
    # the gradient in the forward where the loss is the last op (mean/sum: a uniform upstream gradient), for the
    # unit gradient of .mean()/.sum(), rescaled in backward: the C++ kernel's fused pass (not symmetric) and the
    # Triton / chunked stripe path (3 products per tile instead of the recomputing backward's 4-5)
    needs_grad = torch.is_grad_enabled() and any(z is not None and z.requires_grad
                                                 for z in (z1, z2, z3, reverse_columns))
    fused = needs_grad and reduction != "none" and (be in ("triton", "chunked") or not symmetric)
    if fused and be == "triton":  # the stripe must fit (else the streaming forward and recomputing backward)
        fused = _stripe_fits_shapes(z1, z2, neg, reverse_columns if symmetric else None, symmetric, len(cfg.dims))
    grad_weight = 0.0
    if fused:
        grad_weight = 1.0 if reduction == "sum" else _mean_weight(z1.shape[0], _compute_dtype(z1.dtype))
    g = guide if guide is not None and fn_margin is not None else Guide(None, None)
    rows, lse, lse_sym, pos, _, hard, hidx, *_ = _op_fwd(
        z1, z2, z3, reverse_columns if symmetric else None, column_ids, anchor_ids, *g, cfg.dims, cfg.weights,
        cfg.temperature, cfg.hard_negative_weight, cfg.a_in, cfg.a_own, cfg.fn_margin, cfg.relative_margin,
        cfg.hinge_margin, cfg.hinge_weight, symmetric, cfg.joint, cfg.positive_offset, be, bool(return_stats),
        grad_weight)
    loss = rows.mean() if reduction == "mean" else rows.sum() if reduction == "sum" else rows
    if not return_stats:
        return loss
    inverse = [order.index(i) for i in range(len(order))]  # ascending -> the caller's order

    def stat(x):  # (D, n) ascending -> (n,) or (n, D) in matryoshka_dims' order
        return x[0] if matryoshka_dims is None else x[inverse].T

    return loss, ContrastiveStats(stat(lse), stat(pos), stat(hard), stat(hidx), stat(lse_sym) if symmetric else None)

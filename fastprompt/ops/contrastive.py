"""Fused in-batch cosine InfoNCE + PromCSE energy-based hinge loss with O(N·d) memory.

``contrastive_loss(z1, z2, z3)`` scores every anchor ``z1[i]`` against every column of ``cat(z2, z3)`` by
cosine similarity, and returns the cross-entropy of the positive ``z2[positive_offset + i]`` (+ an optional
symmetric term and the PromCSE hinge). The kernels never materialise the N x M similarity matrix: the
forward streams column tiles with an online log-sum-exp and a running max/argmax for the hardest
negative and saves only per-row statistics; the backward recomputes the tiles. On the CPU, when the
gradient is needed and the reduction is mean/sum (not symmetric), the forward computes the gradients
too from the same tiles (for the unit upstream gradient; the backward only rescales them).

Backends: ``"triton"`` (CUDA; on CPU tensors the Triton interpreter), ``"cpu"`` (the C++ kernel of
``fastprompt._C``, CPU tensors only), ``"reference"`` (plain PyTorch,
:func:`fastprompt.ops.reference.contrastive_loss_reference`) and ``"auto"``, resolved by the rule shared by
every op (:func:`fastprompt.backends.resolve_backend`; this op declares :data:`SUPPORT`). The triton/cpu
kernels are one ``torch.library`` custom op
(``fastprompt::contrastive_loss_fwd`` + ``_bwd``, with fake implementations), so ``torch.compile`` sees a
single opaque node.

Definitions (documented in docs/ops/contrastive_loss.md): cosines ``s_ij``; logits
``l_ij = s_ij / temperature``, plus ``hard_negative_weight`` on the anchor's own hard negative (column
``M2 + p(i)``, i.e. ``z3[p(i)]``; the other z3 rows are plain negatives, as in SimCSE); ``ce_i = lse_i - l_i,p(i)``;
with ``symmetric`` the row loss is ``(ce_i + ce_sym_i) / 2``, ``ce_sym_i`` being the cross-entropy of the
positive ``z2[p(i)]`` against the columns ``z1`` (label ``i``; in the gathered setting only the local z1
rows are its columns). PromCSE's hinge ``relu(hinge_margin + s_i,h(i) - s_i,p(i))`` uses the hardest
negative ``h(i) = argmax_{j != p(i)} s_ij`` on cosines, *without* the hard-negative bias, exactly as
PromCSE's ``cl_forward`` (max over the masked cosine matrix, then ``MarginRankingLoss``). Exact ties pick
the lowest column index in the kernels.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np
import torch

from fastprompt.backends import OpSupport, register_op, resolve_backend
from fastprompt.choices import REDUCTIONS, check_choice
from fastprompt.ops import _cpp
from fastprompt.ops.reference import contrastive_loss_reference

__all__ = ["contrastive_loss", "ContrastiveStats", "SUPPORT"]

#: What the backends take (the rule that chooses among them: :func:`fastprompt.backends.resolve_backend`).
SUPPORT = register_op(OpSupport(
    name="contrastive_loss",
    triton_dtypes=(torch.float16, torch.bfloat16, torch.float32),
    native="the C++ kernel of fastprompt._C",
    native_devices=("cpu",),
    native_missing=_cpp.missing_reason,
))


class ContrastiveStats(NamedTuple):
    """Per-anchor statistics (detached). ``hardest_neg_index`` indexes the columns ``cat(z2, z3)``."""

    lse: torch.Tensor  # log-sum-exp of the anchor's logits (temperature-scaled, hard-negative bias included)
    pos_sim: torch.Tensor  # cosine with its positive
    hardest_neg_sim: torch.Tensor  # largest cosine over the other columns
    hardest_neg_index: torch.Tensor  # int64 column index of that negative
    lse_sym: Optional[torch.Tensor] = None  # symmetric term's log-sum-exp per positive (symmetric only)


# ------------------------------------------------------------------------------------------------
# validation


def _validate(z1, z2, z3, temperature, hard_negative_weight, hinge_margin, hinge_weight, symmetric,
              reduction, positive_offset, check_finite):
    names = (("z1", z1), ("z2", z2)) + ((("z3", z3),) if z3 is not None else ())
    for name, z in names:
        if not isinstance(z, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(z).__name__}")
        if z.dim() != 2:
            raise ValueError(f"{name} must be 2-D (rows, dim), got shape {tuple(z.shape)}")
        if not z.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {z.dtype}")
        if z.dtype != z1.dtype or z.device != z1.device:
            raise ValueError(f"{name} is {z.dtype} on {z.device} but z1 is {z1.dtype} on {z1.device}")
        if z.shape[1] != z1.shape[1]:
            raise ValueError(f"{name} has dim {z.shape[1]} but z1 has dim {z1.shape[1]}")
    n, m2 = z1.shape[0], z2.shape[0]
    if n == 0 or z1.shape[1] == 0:
        raise ValueError(f"z1 must have at least one row and one column, got shape {tuple(z1.shape)}")
    if z3 is not None and z3.shape[0] != m2:
        raise ValueError(f"z3 must have as many rows as z2 ({m2}), got {z3.shape[0]}")
    if isinstance(positive_offset, bool) or not isinstance(positive_offset, int):
        raise ValueError(f"positive_offset must be an int, got {positive_offset!r}")
    if m2 < n:
        raise ValueError(f"z2 needs at least as many rows as z1 (each anchor needs a positive): {m2} < {n}")
    if not 0 <= positive_offset <= m2 - n:
        raise ValueError(
            f"positive_offset={positive_offset} out of range: the positives z2[offset:offset+{n}] must lie in "
            f"the {m2} rows of z2 (0 <= offset <= {m2 - n})"
        )
    m = m2 * (2 if z3 is not None else 1)
    if m < 2:
        raise ValueError(
            "an in-batch contrastive loss needs at least 2 columns (a positive and a negative); got N=1 "
            "anchor, 1 positive and no hard negative"
        )
    if symmetric and n < 2:
        raise ValueError("symmetric=True needs at least 2 anchors (the reverse term has z1 as its columns)")
    for name, v in (("temperature", temperature), ("hard_negative_weight", hard_negative_weight),
                    ("hinge_margin", hinge_margin), ("hinge_weight", hinge_weight)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if hinge_weight < 0:
        raise ValueError(f"hinge_weight must be >= 0, got {hinge_weight}")
    check_choice("reduction", reduction, REDUCTIONS)
    if check_finite and not torch.compiler.is_compiling():
        for name, z in names:
            if not bool(torch.isfinite(z).all()):
                raise ValueError(f"{name} contains NaN or Inf values")


# ------------------------------------------------------------------------------------------------
# the torch.library op: forward returns per-row losses + statistics, backward recomputes the tiles


def _compute_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _mean_weight(n: int, dtype: torch.dtype) -> float:
    """1/n rounded as MeanBackward rounds it in ``dtype``, so that loss.backward() rescales by exactly 1."""
    return float(np.float32(1.0) / np.float32(n)) if dtype == torch.float32 else 1.0 / n


def _kernel_fwd(z1, z2, z3, temperature, hnw, margin, hw, symmetric, offset, backend, track_hardest, grad_weight):
    """Forward kernels; with ``grad_weight`` > 0 (CPU only) also the gradients for that uniform per-row
    upstream gradient, from the same tiles (dz1, dz2, dz3 in the input dtype; empty otherwise)."""
    if backend == "cpu":
        cdt = _compute_dtype(z1.dtype)  # the C++ kernel is float/double: half inputs are upcast (O(N·d))
        z3c = None if z3 is None else z3.to(cdt).contiguous()
        out = torch.ops.fastprompt.contrastive_loss_cpu_fwd(
            z1.to(cdt).contiguous(), z2.to(cdt).contiguous(), z3c, temperature, hnw, margin, hw, symmetric,
            offset, track_hardest, grad_weight > 0, grad_weight)
        return tuple(out[:6]) + tuple(g.to(z1.dtype) for g in out[6:])
    if backend == "triton":
        from fastprompt.kernels import contrastive_loss as tk

        stats = tk.forward(z1, z2, z3, temperature, hnw, margin, hw, symmetric, offset, track_hard=track_hardest)
        return stats + tuple(z1.new_empty((0, z1.shape[1])) for _ in range(3))  # distinct: no aliasing
    raise ValueError(f"unknown kernel backend {backend!r}")


def _kernel_bwd(grad, z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx, temperature, hnw, margin, hw,
                symmetric, offset, backend):
    if backend == "cpu":
        cdt = _compute_dtype(z1.dtype)
        z3c = None if z3 is None else z3.to(cdt).contiguous()
        d1, d2, d3 = torch.ops.fastprompt.contrastive_loss_cpu_bwd(
            grad.to(cdt).contiguous(), z1.to(cdt).contiguous(), z2.to(cdt).contiguous(), z3c, lse, lse_sym,
            pos_sim, hard_sim, hard_idx, temperature, hnw, margin, hw, symmetric, offset)
        return d1.to(z1.dtype), d2.to(z1.dtype), d3.to(z1.dtype)
    if backend == "triton":
        from fastprompt.kernels import contrastive_loss as tk

        return tk.backward(grad, z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx, temperature, hnw, margin,
                           hw, symmetric, offset)
    raise ValueError(f"unknown kernel backend {backend!r}")


@torch.library.custom_op("fastprompt::contrastive_loss_fwd", mutates_args=())
def _op_fwd(z1: torch.Tensor, z2: torch.Tensor, z3: Optional[torch.Tensor], temperature: float,
            hard_negative_weight: float, hinge_margin: float, hinge_weight: float, symmetric: bool,
            positive_offset: int, backend: str, track_hardest: bool, grad_weight: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row_loss, lse, lse_sym, pos_sim, hard_sim, hard_idx, dz1, dz2, dz3). lse_sym has 0 rows unless
    symmetric; the hardest-negative outputs are NaN / -1 unless track_hardest (always tracked when
    hinge_weight != 0); dz* are the gradients for the uniform per-row upstream gradient ``grad_weight``
    when it is > 0 (the CPU kernel's fused forward+backward), else empty."""
    return _kernel_fwd(z1, z2, z3, temperature, hard_negative_weight, hinge_margin, hinge_weight, symmetric,
                       positive_offset, backend, track_hardest or hinge_weight != 0.0, grad_weight)


@_op_fwd.register_fake
def _op_fwd_fake(z1, z2, z3, temperature, hard_negative_weight, hinge_margin, hinge_weight, symmetric,
                 positive_offset, backend, track_hardest, grad_weight):
    n, cdt = z1.shape[0], _compute_dtype(z1.dtype)
    vec = lambda k: z1.new_empty((k,), dtype=cdt)  # noqa: E731
    empty = lambda: z1.new_empty((0, z1.shape[1]))  # noqa: E731
    if grad_weight > 0:
        grads = (torch.empty_like(z1), torch.empty_like(z2), torch.empty_like(z3) if z3 is not None else empty())
    else:
        grads = (empty(), empty(), empty())
    return (vec(n), vec(n), vec(n if symmetric else 0), vec(n), vec(n),
            z1.new_empty((n,), dtype=torch.int64)) + grads


@torch.library.custom_op("fastprompt::contrastive_loss_bwd", mutates_args=())
def _op_bwd(grad: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor, z3: Optional[torch.Tensor],
            lse: torch.Tensor, lse_sym: torch.Tensor, pos_sim: torch.Tensor, hard_sim: torch.Tensor,
            hard_idx: torch.Tensor, temperature: float, hard_negative_weight: float, hinge_margin: float,
            hinge_weight: float, symmetric: bool, positive_offset: int, backend: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dz1, dz2, dz3); dz3 is an empty tensor when z3 is None."""
    d1, d2, d3 = _kernel_bwd(grad, z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx, temperature,
                             hard_negative_weight, hinge_margin, hinge_weight, symmetric, positive_offset,
                             backend)
    return d1, d2, (d3 if d3 is not None else z1.new_empty((0, z1.shape[1])))


@_op_bwd.register_fake
def _op_bwd_fake(grad, z1, z2, z3, *args):
    return (torch.empty_like(z1), torch.empty_like(z2),
            torch.empty_like(z3) if z3 is not None else z1.new_empty((0, z1.shape[1])))


def _setup_context(ctx, inputs, output):
    z1, z2, z3, *params = inputs
    _, lse, lse_sym, pos_sim, hard_sim, hard_idx, g1, g2, g3 = output
    ctx.grad_weight = params[-1]
    ctx.n_params = len(params)
    ctx.has_z3 = z3 is not None
    ctx.mark_non_differentiable(lse, lse_sym, pos_sim, hard_sim, hard_idx, g1, g2, g3)
    if ctx.grad_weight > 0:  # the forward already computed the gradients (for a uniform upstream gradient)
        ctx.save_for_backward(g1, g2, g3 if z3 is not None else None)
    else:
        ctx.save_for_backward(z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx)
        ctx.params = params[:-2]  # all but track_hardest and grad_weight, in the order _op_bwd takes them


def _backward(ctx, grad_rows, *unused):
    if ctx.grad_weight > 0:
        # rows.mean()/.sum() of the wrapper make grad_rows uniform: rescale the precomputed gradients
        g1, g2, g3 = ctx.saved_tensors
        factor = grad_rows[0] / ctx.grad_weight if grad_rows is not None else 0.0
        # (eager only: a plain tensor; tracing sees fake / functional tensor subclasses, no data to test)
        eager = type(grad_rows) is torch.Tensor and not torch.compiler.is_compiling()
        if eager and float(factor) == 1.0:
            grads = (g1, g2, g3)  # the usual loss.backward(): no copy
        else:
            grads = tuple(None if g is None else g * factor.to(g.dtype) for g in (g1, g2, g3))
        return grads + (None,) * ctx.n_params
    z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx = ctx.saved_tensors
    if grad_rows is None:
        grad_rows = lse.new_zeros(lse.shape)
    d1, d2, d3 = _op_bwd(grad_rows.contiguous(), z1, z2, z3, lse, lse_sym, pos_sim, hard_sim, hard_idx,
                         *ctx.params)
    return (d1, d2, d3 if ctx.has_z3 else None) + (None,) * ctx.n_params


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
    reduction: str = "mean",
    return_stats: bool = False,
    positive_offset: int = 0,
    backend: str = "auto",
    check_finite: bool = True,
):
    """Cosine InfoNCE over the columns ``cat(z2, z3)`` + ``hinge_weight`` x PromCSE's energy-based hinge.

    Args:
        z1: (N, d) anchors.
        z2: (M2, d) positives / in-batch columns, M2 >= N; the positive of ``z1[i]`` is
            ``z2[positive_offset + i]`` (M2 > N when z2 was all-gathered across processes, with
            ``positive_offset = rank * N``).
        z3: optional (M2, d) hard negatives, extra columns.
        temperature: logits are cosine / temperature.
        hard_negative_weight: added to the logit of each anchor's own hard negative ``z3[positive_offset + i]``
            (the log of SimCSE's weight; the other z3 rows stay plain negatives).
        hinge_margin, hinge_weight: PromCSE's L_EH = relu(margin + cos(z1_i, hardest negative) - cos(z1_i,
            positive)), added with this weight (PromCSE uses margin 0.2, weight 10; 0 disables it).
        symmetric: average the loss with the reverse term (positives z2[p(i)] against the columns z1).
        reduction: "mean" | "sum" | "none" (per-anchor losses).
        return_stats: also return a :class:`ContrastiveStats` (per-row lse, positive / hardest-negative
            cosine and the hardest negative's column index).
        positive_offset: row of z2 holding the positive of z1[0].
        backend: "auto" (CUDA -> Triton, CPU -> C++ if built, else the reference with a one-time warning),
            "triton" (CPU tensors run in the Triton interpreter), "cpu", "reference"; see
            :func:`fastprompt.backends.resolve_backend`.
        check_finite: raise ValueError on NaN/Inf inputs (one pass over the inputs; skipped under
            torch.compile).

    Returns the loss (float32, or float64 for float64 inputs), or ``(loss, stats)`` with ``return_stats``.
    Gradients flow to z1, z2 and z3.
    """
    _validate(z1, z2, z3, temperature, hard_negative_weight, hinge_margin, hinge_weight, symmetric, reduction,
              positive_offset, check_finite)
    be = resolve_backend(SUPPORT, z1, backend)
    kw = dict(temperature=float(temperature), hard_negative_weight=float(hard_negative_weight),
              hinge_margin=float(hinge_margin), hinge_weight=float(hinge_weight), symmetric=bool(symmetric),
              positive_offset=int(positive_offset))
    if be == "reference":
        return contrastive_loss_reference(z1, z2, z3, reduction=reduction, return_stats=return_stats, **kw)
    # CPU kernel, mean/sum, not symmetric: forward and backward in one pass over the tiles (3 products per
    # tile instead of 4); the gradients are computed for the per-row upstream gradient of .mean()/.sum()
    # of a unit loss gradient, and rescaled in backward
    needs_grad = torch.is_grad_enabled() and any(z is not None and z.requires_grad for z in (z1, z2, z3))
    grad_weight = 0.0
    if be == "cpu" and needs_grad and reduction != "none" and not symmetric:
        grad_weight = 1.0 if reduction == "sum" else _mean_weight(z1.shape[0], _compute_dtype(z1.dtype))
    rows, lse, lse_sym, pos_sim, hard_sim, hard_idx, *_ = _op_fwd(
        z1, z2, z3, kw["temperature"], kw["hard_negative_weight"], kw["hinge_margin"], kw["hinge_weight"],
        kw["symmetric"], kw["positive_offset"], be, bool(return_stats), grad_weight)
    loss = rows.mean() if reduction == "mean" else rows.sum() if reduction == "sum" else rows
    if not return_stats:
        return loss
    return loss, ContrastiveStats(lse, pos_sim, hard_sim, hard_idx, lse_sym if symmetric else None)

"""Fused dropout + residual add + LayerNorm, ``layer_norm(dropout(x) + residual)``: the closing step of a
BERT-style attention or feed-forward block (``dense -> dropout -> LayerNorm(h + input)``), as one C++ CPU op
(``csrc/dropout_add_norm.cpp``), forward and backward.

Why: under SimCSE's dropout, eager PyTorch's ``nn.Dropout`` on the CPU was the largest cost of a packed training
step after the matrix products (``aten::bernoulli_``: ~8.6 ns per element on the 2-core AMD EPYC, 163 ms of a 1.9 s
step of all-MiniLM-L6-v2 at 64 pairs x 32 tokens; docs/ops/dropout_add_norm.md). The fused op draws its dropout
decisions with the counter-based Philox generator of the attention kernels, reads and writes each row once, and keeps
the decisions as bits instead of a byte mask.

The same maths as the module: kept values are scaled by ``1 / (1 - p)`` and each element is kept with probability
``1 - p`` (to within 2^-33), but the draws differ from torch's generator (as torch.compile's do). The seed is
drawn from torch's default CPU generator, so restoring ``torch.get_rng_state()`` replays the same decisions
(resumed runs and activation checkpointing rely on it). :func:`keep_mask` returns the decisions of a seed;
:func:`fastprompt.ops.reference.dropout_add_layer_norm_reference` is the plain-PyTorch ground truth given them.

float32 CPU tensors only (:func:`applies`): the model adapter (:mod:`fastprompt.model.add_norm`) runs the
module's own forward everywhere else.

Why this op has no ``backend`` argument and no :class:`~fastprompt.backends.OpSupport` (the other two ops have
both): there is nothing to choose among. It is one kernel, the C++ CPU one, with no Triton counterpart; where it
does not apply (CUDA, half precision, the extension not built) the module's own forward is not a slower fallback
to warn about but aten's own fused path, the one every model runs without fastprompt. So the choice is the model
adapter's, per module and input (:func:`applies`, the op's declared limits), and the backend rule with its
"falls back to the reference" warning would only add noise. It shares with the other ops what they share: the
extension's loader and its Philox seed (:mod:`fastprompt.ops._cpp`), a ``torch.library`` op with a fake
implementation and a registered backward, the reference in :mod:`fastprompt.ops.reference`; it imports no other op.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastprompt.ops import _cpp
from fastprompt.ops._cpp import signed_seed


def _draw_seed_tensor() -> torch.Tensor:
    """A 63-bit seed drawn from torch's default CPU generator (draw_seed's draw), left as a 0-d int64 tensor."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64)


def applies(x: torch.Tensor, dropout_p: float) -> bool:
    """Whether the fused op takes ``x`` at this dropout: a float32 CPU tensor, 0 <= p < 1, extension built."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and 0.0 <= dropout_p < 1.0 and _cpp.available()


def dropout_add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                           bias: torch.Tensor | None, eps: float, dropout_p: float,
                           seed: int | None = None) -> torch.Tensor:
    """``layer_norm(dropout(x, dropout_p) + residual, (C,), weight, bias, eps)`` over the last dimension C, with
    gradients for every input that requires one. ``seed`` None draws one from torch's default CPU generator
    (only when ``dropout_p > 0``). Raises where :func:`applies` is false."""
    if not applies(x, dropout_p):
        raise ValueError(f"dropout_add_layer_norm: needs float32 CPU tensors, 0 <= dropout_p < 1 and the C++ "
                         f"extension (got {x.dtype} on {x.device}, dropout_p={dropout_p}"
                         f"{'' if _cpp.available() else '; ' + str(_cpp.missing_reason())})")
    if residual.shape != x.shape:
        raise ValueError(f"dropout_add_layer_norm: residual {tuple(residual.shape)} must have x's shape "
                         f"{tuple(x.shape)}")
    C = x.shape[-1]
    for name, t, shape in (("residual", residual, x.shape), ("weight", weight, (C,)), ("bias", bias, (C,))):
        if t is not None and (tuple(t.shape) != tuple(shape) or t.dtype != torch.float32 or t.device != x.device):
            raise ValueError(f"dropout_add_layer_norm: {name} must be a float32 CPU tensor of shape {tuple(shape)} "
                             f"(x's last dimension {C}), got {t.dtype} {tuple(t.shape)} on {t.device}")
    if seed is None:  # from torch's default CPU generator, so its RNG state replays the draw; as a tensor, which
        # the kernel reads itself (no host read of it here)
        seed_t = _draw_seed_tensor() if dropout_p > 0 else torch.zeros((), dtype=torch.int64)
    else:
        seed_t = torch.tensor(signed_seed(seed), dtype=torch.int64)
    y, _, _, _ = _fwd_op(x.reshape(-1, C).contiguous(), residual.reshape(-1, C).contiguous(),
                         None if weight is None else weight.contiguous(),
                         None if bias is None else bias.contiguous(), float(eps), float(dropout_p), seed_t)
    return y.view(x.shape)


def keep_mask(rows: int, cols: int, dropout_p: float, seed: int) -> torch.Tensor:
    """The fused op's keep decisions (rows, cols) bool (True = kept) for a seed, over the rows of its flattened
    (rows, C = cols) input."""
    _cpp.extension()
    return torch.ops.fastprompt.dropout_add_layer_norm_cpu_keep_mask(rows, cols, float(dropout_p),
                                                                     signed_seed(seed))


# ------------------------------------------------------------------------------------------------
# the op: the C++ kernels (fastprompt::dropout_add_layer_norm_cpu_fwd / _bwd, which know nothing of autograd) wrapped
# in torch.library custom ops with fake implementations and a registered backward


@torch.library.custom_op("fastprompt::dropout_add_layer_norm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
            eps: float, dropout_p: float, seed: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, xhat, rstd, keep bits) of (rows, C) float32 inputs (the kernel's outputs; xhat, rstd and the bits are
    saved for the backward)."""
    return torch.ops.fastprompt.dropout_add_layer_norm_cpu_fwd(x, residual, weight, bias, eps, dropout_p, seed)


@_fwd_op.register_fake
def _fwd_fake(x, residual, weight, bias, eps, dropout_p, seed):
    N, C = x.shape
    return (x.new_empty(N, C), x.new_empty(N, C), x.new_empty(N),
            x.new_empty(N, (C + 7) // 8 if dropout_p > 0 else 0, dtype=torch.uint8))


@torch.library.custom_op("fastprompt::dropout_add_layer_norm_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, xhat: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor],
            keep_bits: torch.Tensor, dropout_p: float, need_dx: bool, need_dresidual: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dresidual); a gradient not asked for is an empty tensor."""
    return torch.ops.fastprompt.dropout_add_layer_norm_cpu_bwd(dy, xhat, rstd, weight, keep_bits, dropout_p, need_dx,
                                                               need_dresidual)


@_bwd_op.register_fake
def _bwd_fake(dy, xhat, rstd, weight, keep_bits, dropout_p, need_dx, need_dresidual):
    return (dy.new_empty(dy.shape if need_dx else (0,)), dy.new_empty(dy.shape if need_dresidual else (0,)))


def _setup_context(ctx, inputs, output):
    _, _, weight, bias, _, dropout_p, _ = inputs
    _, xhat, rstd, bits = output
    ctx.save_for_backward(xhat, rstd, bits, weight)
    ctx.dropout_p = dropout_p
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(xhat, rstd, bits)
    ctx.set_materialize_grads(False)


def _backward(ctx, dy, _dxhat, _drstd, _dbits):
    if dy is None:
        return (None,) * 7
    xhat, rstd, bits, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    dy = dy.contiguous()
    dx, dres = _bwd_op(dy, xhat, rstd, weight, bits, ctx.dropout_p, need[0], need[1])
    # the LayerNorm's own parameters (frozen in prompt tuning): sums over the rows, here rather than in the kernel
    dweight = (dy * xhat).sum(0) if weight is not None and need[2] else None
    dbias = dy.sum(0) if ctx.has_bias and need[3] else None
    return (dx if need[0] else None, dres if need[1] else None, dweight, dbias, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)

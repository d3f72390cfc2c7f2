"""Fused prefix attention: every token attends to a trainable prompt prefix and to its own sequence,
without the prefix ever being expanded over the batch or concatenated with the token keys/values.

``prefix_attention(q, k, v, prefix_k, prefix_v, key_padding_mask)`` computes, per example b and head h,
``softmax(q K^T * scale) V`` over the keys ``K = [prefix_k ; k[b]]`` (values likewise), with the prefix
always visible and padded tokens (``key_padding_mask`` False) hidden. The prefix is ``(H, P, D)`` shared
by the batch, or ``(T, H, P, D)`` with ``prompt_index`` (B,) picking each example's prompt (several tasks
in one batch on one frozen backbone).

Backends:

``"triton"``     the kernels of ``fastprompt.kernels.prefix_attention`` (online softmax over the prefix
                 tiles then the token tiles; the backward recomputes from the saved log-sum-exp; prefix
                 gradients are per-program partial sums reduced in a fixed order). On CPU tensors this
                 runs the Triton interpreter (``TRITON_INTERPRET=1`` before the kernels are imported).
``"cpu"``        PyTorch composite, fastest measured on CPU: the fused CPU flash-attention kernel over an
                 on-the-fly concatenation (dropout 0, P >= 1), else a segment-wise matmul path that never
                 concatenates K/V. Runs on any device (it is the CUDA fallback for D > 128 or float64).
``"reference"``  :func:`fastprompt.ops.reference.prefix_attention_reference` (explicit concatenation, autograd).
``"auto"``       CUDA -> "triton" (when supported), otherwise "cpu".

"triton" and "cpu" are one ``torch.library`` custom op (``fastprompt::prefix_attention_fwd`` / ``_bwd``
with fake implementations and a registered autograd formula), so ``torch.compile`` sees a single node.

Dropout acts on the attention probabilities. Its mask is a pure function of ``seed`` and the position:
the same seed reproduces the same mask exactly (the gradient cache replays forwards). ``seed=None`` with
``dropout_p > 0`` draws the seed from torch's default CPU generator, so restoring ``torch.get_rng_state()``
replays it. The Triton kernels use Philox in-kernel; the CPU/reference paths use a seeded
``torch.Generator`` (same contract, different masks).

A row that sees no key at all (P = 0 and an all-padding example) outputs zeros. With P >= 1 every row
sees the prefix, so a fully padded example simply attends to the prompt: finite output, no NaN.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from fastprompt.ops.reference import prefix_attention_dropout_mask, prefix_attention_reference

__all__ = ["prefix_attention", "BACKENDS", "resolve_backend", "draw_seed"]

BACKENDS = ("auto", "triton", "cpu", "reference")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_TRITON_HEAD_DIM = 128


# ------------------------------------------------------------------------------------------------
# public API


def prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    prompt_index: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of token queries over ``[prefix ; tokens]``; returns ``(B, H, S, D)`` in q's dtype.

    Args:
        q, k, v: ``(B, H, S, D)`` (any strides, e.g. transformers' ``view(...).transpose(1, 2)``).
        prefix_k, prefix_v: ``(H, P, D)`` shared by the batch, or ``(T, H, P, D)`` with ``prompt_index``.
        key_padding_mask: ``(B, S)``, True (or 1) = real token; None = no padding. Prefix keys are always
            visible.
        scale: score scale, default ``D ** -0.5``.
        dropout_p: dropout probability on the attention probabilities (0 in eval).
        seed: dropout seed (any int, 64 bits used); None draws one from torch's default generator.
        prompt_index: ``(B,)`` integer prompt id per example, required with a 4-D prefix.
        backend: "auto", "triton", "cpu" or "reference" (see the module docstring).

    The returned tensor of the "triton" and "cpu" backends has the memory layout of a transposed
    ``(B, S, H, D)`` tensor, so ``out.transpose(1, 2).reshape(B, S, H * D)`` needs no copy.
    """
    _validate(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, dropout_p, backend)
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    if prompt_index is not None:
        prompt_index = prompt_index.to(torch.long)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if dropout_p > 0 and seed is None:
        seed = draw_seed()
    seed = 0 if seed is None else int(seed)
    resolved = resolve_backend(backend, q)
    if resolved == "reference":
        return prefix_attention_reference(q, k, v, prefix_k, prefix_v, mask, scale=scale, dropout_p=dropout_p,
                                          seed=seed, prompt_index=prompt_index)
    out, _, _ = torch.ops.fastprompt.prefix_attention_fwd(q, k, v, prefix_k, prefix_v, mask, prompt_index, scale,
                                                          dropout_p, seed, resolved)
    return out


def draw_seed() -> int:
    """A fresh 63-bit dropout seed from torch's default CPU generator (replayable via its RNG state)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64).item())


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401

        from fastprompt.kernels import prefix_attention  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The concrete backend ("triton", "cpu" or "reference") that ``backend`` means for ``q``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    triton_ok = q.dtype in _TRITON_DTYPES and q.shape[-1] <= _MAX_TRITON_HEAD_DIM
    if backend == "auto":
        return "triton" if (q.is_cuda and triton_ok and _triton_available()) else "cpu"
    if backend == "triton":
        if not triton_ok:
            raise ValueError(f"backend='triton' supports {_TRITON_DTYPES} and head dims <= {_MAX_TRITON_HEAD_DIM}; "
                             f"got {q.dtype} with D = {q.shape[-1]} (use backend='cpu' or 'auto')")
        if not _triton_available():
            raise ValueError("backend='triton' needs the triton package (pip install triton)")
        if not q.is_cuda:
            from fastprompt.kernels.prefix_attention import interpreting

            if not interpreting():
                raise ValueError("backend='triton' on CPU tensors needs the Triton interpreter: set "
                                 "TRITON_INTERPRET=1 before fastprompt.kernels is imported (or use backend='cpu')")
    return backend


def _validate(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, dropout_p, backend):
    for name, x in (("q", q), ("k", k), ("v", v), ("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {x.dtype}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} is {x.dtype} on {x.device} but q is {q.dtype} on {q.device}; "
                             "cast the prefix to the activations' dtype")
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, S, D), got shape {tuple(q.shape)}")
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have the same (B, H, S, D) shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, H, S, D = q.shape
    if prefix_k.shape != prefix_v.shape:
        raise ValueError(f"prefix_k {tuple(prefix_k.shape)} and prefix_v {tuple(prefix_v.shape)} differ in shape")
    if prefix_k.dim() not in (3, 4) or prefix_k.shape[-3] != H or prefix_k.shape[-1] != D:
        raise ValueError(f"prefix_k must be (H, P, D) = ({H}, P, {D}) or (T, {H}, P, {D}), "
                         f"got {tuple(prefix_k.shape)}")
    if prefix_k.dim() == 4:
        if prompt_index is None:
            raise ValueError("a (T, H, P, D) prefix needs prompt_index (B,) choosing each example's prompt")
        if not isinstance(prompt_index, torch.Tensor) or prompt_index.shape != (B,) or \
                prompt_index.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompt_index must be an int64/int32 tensor of shape ({B},), got "
                             f"{getattr(prompt_index, 'dtype', type(prompt_index))} "
                             f"{tuple(getattr(prompt_index, 'shape', ()))}")
        if prompt_index.device != q.device:
            raise ValueError(f"prompt_index is on {prompt_index.device} but q is on {q.device}")
        if prefix_k.shape[0] == 0:
            raise ValueError("a (T, H, P, D) prefix needs T >= 1 prompts")
    elif prompt_index is not None:
        raise ValueError("prompt_index is only meaningful with a (T, H, P, D) prefix; got an (H, P, D) prefix")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.shape != (B, S):
            raise ValueError(f"key_padding_mask must be a (B, S) = ({B}, {S}) tensor, got "
                             f"{tuple(getattr(key_padding_mask, 'shape', ()))}")
        if key_padding_mask.is_floating_point() or key_padding_mask.is_complex():
            raise ValueError(f"key_padding_mask must be bool (True = real token) or 0/1 integers, "
                             f"got {key_padding_mask.dtype}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_prompt_index(prompt_index: Optional[torch.Tensor], T: int) -> None:
    """Out-of-range prompt ids would read out of bounds in the kernels: check without a host sync on CUDA."""
    if prompt_index is None:
        return
    bad = ((prompt_index < 0) | (prompt_index >= T)).any()
    if prompt_index.is_cuda:
        torch._assert_async(~bad, f"prompt_index out of range [0, {T})")
    elif bool(bad):
        raise ValueError(f"prompt_index values must be in [0, {T}), got min {int(prompt_index.min())}, "
                         f"max {int(prompt_index.max())}")


# ------------------------------------------------------------------------------------------------
# the "cpu" backend: PyTorch composite with an explicit backward (saves only out + log-sum-exp)

_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _per_example_prefix(prefix: torch.Tensor, prompt_index, B: int) -> torch.Tensor:
    """(B, H, P, D): an expand (no copy) of a shared prefix, or the gather of each example's prompt."""
    if prefix.dim() == 3:
        return prefix.unsqueeze(0).expand(B, -1, -1, -1)
    return prefix[prompt_index]


def _use_flash(q, P, dropout_p) -> bool:
    # The fused CPU kernel has no dropout, and with P = 0 a fully padded row would have no visible key.
    return q.device.type == "cpu" and dropout_p == 0.0 and P > 0


def _concat(q, k, v, prefix_k, prefix_v, mask, prompt_index):
    """[prefix ; tokens] keys and values stacked as one contiguous (2, B, H, P + S, D) tensor, and the
    additive mask (B, 1, 1, P + S). (Contiguous (B, H, L, D) keys/values are what the CPU flash backward
    runs fastest on: a (B, L, H, D)-strided build made it markedly slower.)"""
    B, H, S, D = k.shape
    P = prefix_k.shape[-2]
    kv = torch.empty((2, B, H, P + S, D), dtype=k.dtype, device=k.device)
    for i, (tokens, prefix) in enumerate(((k, prefix_k), (v, prefix_v))):
        kv[i, :, :, P:] = tokens
        kv[i, :, :, :P] = prefix if prefix.dim() == 3 else prefix[prompt_index]
    bias = q.new_zeros(B, 1, 1, P + S)
    if mask is not None:
        bias[:, 0, 0, P:].masked_fill_(~mask, float("-inf"))
    return kv, bias


def _reduce_prefix_grad(grad: torch.Tensor, prefix: torch.Tensor, prompt_index) -> torch.Tensor:
    """(B, H, P, D) per-example prefix gradient -> prefix's shape: a deterministic sum over the batch
    (per prompt: a one-hot matmul, which has a fixed reduction order unlike index_add_ on CUDA)."""
    if prefix.dim() == 3:
        return grad.sum(0).to(prefix.dtype)
    onehot = torch.nn.functional.one_hot(prompt_index, prefix.shape[0]).to(grad.dtype)  # (B, T)
    return (onehot.t() @ grad.flatten(1)).view(prefix.shape).to(prefix.dtype)


def _segment_scores(q, k, pk, scale, mask):
    """Scores over [prefix ; tokens] as one (B, H, S, P + S) tensor, computed per segment (the prefix
    product broadcasts over the batch; K/V are never concatenated)."""
    qs = q * scale
    s = torch.cat([torch.matmul(qs, pk.transpose(-1, -2)), torch.matmul(qs, k.transpose(-1, -2))], -1)
    if mask is not None:
        P = pk.shape[-2]
        s[..., P:].masked_fill_(~mask[:, None, None, :], float("-inf"))
    return s


def _cpu_compute_dtype(dtype):
    # Half precision is computed in float32 on the CPU: no speed to gain there, and the prefix gradients sum
    # B * S products, which half-precision partials would round visibly.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _bshd_like(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) in the transposed-(B, S, H, D) layout the custom op promises (a copy only if needed;
    the CPU flash kernel already writes its output in the layout of q)."""
    if x.transpose(1, 2).is_contiguous():
        return x
    B, H, S, D = x.shape
    out = torch.empty((B, S, H, D), dtype=x.dtype, device=x.device).transpose(1, 2)
    return out.copy_(x)


def _no_concat():
    return torch.empty(0)


def _cpu_forward(q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed):
    """Returns (out, lse, kv): kv is the concatenation the backward reuses (flash path) or an empty tensor."""
    B, H, S, D = q.shape
    P = prefix_k.shape[-2]
    cd = _cpu_compute_dtype(q.dtype)
    if _use_flash(q, P, dropout_p):
        q32, k32, v32, pk32, pv32 = (x.to(cd) for x in (q, k, v, prefix_k, prefix_v))
        kv, bias = _concat(q32, k32, v32, pk32, pv32, mask, prompt_index)
        out, lse = _flash_fwd(q32, kv[0], kv[1], 0.0, False, attn_mask=bias, scale=scale)
        return _bshd_like(out.to(q.dtype)), lse.float(), kv
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    pk, pv = (_per_example_prefix(p, prompt_index, B).to(cd) if p.dim() == 4 else p.to(cd)
              for p in (prefix_k, prefix_v))
    s = _segment_scores(qc, kc, pk, scale, mask)
    lse = torch.logsumexp(s, -1)
    lse_safe = lse.masked_fill(torch.isinf(lse), 0.0)  # rows without any visible key -> probabilities 0
    p = s.sub_(lse_safe[..., None]).exp_()
    if dropout_p > 0:
        keep = prefix_attention_dropout_mask(seed, p.shape, dropout_p, q.device)
        p.mul_(keep).mul_(1.0 / (1.0 - dropout_p))
    out = torch.matmul(p[..., :P], pv) + torch.matmul(p[..., P:], vc)
    return _bshd_like(out.to(q.dtype)), lse.float(), _no_concat()


def _cpu_backward(dout, q, k, v, prefix_k, prefix_v, out, lse, kv, mask, prompt_index, scale, dropout_p, seed):
    B, H, S, D = q.shape
    P = prefix_k.shape[-2]
    cd = _cpu_compute_dtype(q.dtype)
    if _use_flash(q, P, dropout_p):
        q32, do32, o32 = (x.to(cd) for x in (q, dout, out))
        bias = q32.new_zeros(B, 1, 1, P + S)
        if mask is not None:
            bias[:, 0, 0, P:].masked_fill_(~mask, float("-inf"))
        dq, dkeys, dvalues = _flash_bwd(do32, q32, kv[0], kv[1], o32, lse, 0.0, False, attn_mask=bias, scale=scale)
        dpk = _reduce_prefix_grad(dkeys[:, :, :P], prefix_k, prompt_index)
        dpv = _reduce_prefix_grad(dvalues[:, :, :P], prefix_v, prompt_index)
        return (dq.to(q.dtype), dkeys[:, :, P:].to(k.dtype), dvalues[:, :, P:].to(v.dtype), dpk, dpv)
    qc, kc, vc, doc, oc = (x.to(cd) for x in (q, k, v, dout, out))
    shared = prefix_k.dim() == 3
    pk, pv = (p.to(cd) if shared else _per_example_prefix(p, prompt_index, B).to(cd) for p in (prefix_k, prefix_v))
    # Recompute the probabilities from the saved log-sum-exp (flash-style: nothing (B, H, S, P+S) was kept).
    s = _segment_scores(qc, kc, pk, scale, mask)
    lse_safe = lse.to(cd).masked_fill(torch.isinf(lse), float("inf"))  # empty rows: exp(-inf) = 0
    p = s.sub_(lse_safe[..., None]).exp_()
    dp = torch.cat([torch.matmul(doc, pv.transpose(-1, -2)), torch.matmul(doc, vc.transpose(-1, -2))], -1)
    if dropout_p > 0:
        keep = prefix_attention_dropout_mask(seed, p.shape, dropout_p, q.device)
        inv = 1.0 / (1.0 - dropout_p)
        dp.mul_(keep).mul_(inv)
        p_drop = p * keep * inv
    else:
        p_drop = p
    delta = (doc * oc).sum(-1, keepdim=True)
    ds = dp.sub_(delta).mul_(p).mul_(scale)
    ds_p, ds_t = ds[..., :P], ds[..., P:]
    dq = torch.matmul(ds_p, pk) + torch.matmul(ds_t, kc)
    dk = torch.matmul(ds_t.transpose(-1, -2), qc)
    dv = torch.matmul(p_drop[..., P:].transpose(-1, -2), doc)
    if shared:  # sum over (batch, query) in one contraction: no per-example (B, H, P, D) tensor
        dpk = torch.einsum("bhsp,bhsd->hpd", ds_p, qc).to(prefix_k.dtype)
        dpv = torch.einsum("bhsp,bhsd->hpd", p_drop[..., :P], doc).to(prefix_v.dtype)
    else:
        dpk = _reduce_prefix_grad(torch.matmul(ds_p.transpose(-1, -2), qc), prefix_k, prompt_index)
        dpv = _reduce_prefix_grad(torch.matmul(p_drop[..., :P].transpose(-1, -2), doc), prefix_v, prompt_index)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dpk, dpv


# ------------------------------------------------------------------------------------------------
# torch.library custom op


def _like(grad: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """grad with the strides ``torch.empty_like(ref)`` has (what the fake implementation promises)."""
    out = torch.empty_like(ref)  # no memory is touched unless the copy below is needed
    if grad.dtype == ref.dtype and grad.stride() == out.stride() and grad.storage_offset() == 0:
        return grad
    return out.copy_(grad)


def _saves_concat(q: torch.Tensor, P: int, dropout_p: float, backend: str) -> bool:
    return backend == "cpu" and _use_flash(q, P, dropout_p)


@torch.library.custom_op("fastprompt::prefix_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
            key_padding_mask: Optional[torch.Tensor], prompt_index: Optional[torch.Tensor], scale: float,
            dropout_p: float, seed: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out, lse, kv): kv holds what the backward needs besides the inputs (the CPU flash path's
    concatenated keys/values, like SDPA on a concatenation keeps them) or is empty."""
    _check_prompt_index(prompt_index, prefix_k.shape[0] if prefix_k.dim() == 4 else 1)
    if backend == "triton":
        from fastprompt.kernels import prefix_attention as kernels

        out, lse = kernels.forward(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale=scale,
                                   dropout_p=dropout_p, seed=seed)
        return out, lse, _no_concat()
    if backend != "cpu":
        raise ValueError(f"fastprompt::prefix_attention_fwd runs backend 'triton' or 'cpu', got {backend!r}")
    return _cpu_forward(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale, dropout_p, seed)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale, dropout_p, seed, backend):
    B, H, S, D = q.shape
    P = prefix_k.shape[-2]
    out = q.new_empty((B, S, H, D)).transpose(1, 2)
    if _saves_concat(q, P, dropout_p, backend):
        kv = q.new_empty((2, B, H, P + S, D), dtype=_cpu_compute_dtype(q.dtype))
    else:
        kv = q.new_empty((0,), dtype=torch.float32)
    return out, q.new_empty((B, H, S), dtype=torch.float32), kv


@torch.library.custom_op("fastprompt::prefix_attention_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
            prefix_v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, kv: torch.Tensor,
            key_padding_mask: Optional[torch.Tensor],
            prompt_index: Optional[torch.Tensor], scale: float, dropout_p: float, seed: int,
            backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if backend == "triton":
        from fastprompt.kernels import prefix_attention as kernels

        grads = kernels.backward(dout, q, k, v, prefix_k, prefix_v, out, lse, key_padding_mask, prompt_index,
                                 scale=scale, dropout_p=dropout_p, seed=seed)
    else:
        grads = _cpu_backward(dout, q, k, v, prefix_k, prefix_v, out, lse, kv, key_padding_mask, prompt_index,
                              scale, dropout_p, seed)
    dq, dk, dv, dpk, dpv = grads
    return _like(dq, q), _like(dk, k), _like(dv, v), dpk.contiguous(), dpv.contiguous()


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, prefix_k, prefix_v, out, lse, kv, key_padding_mask, prompt_index, scale, dropout_p,
              seed, backend):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            prefix_k.new_empty(prefix_k.shape), prefix_v.new_empty(prefix_v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, backend = inputs
    out, lse, kv = output
    ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse, kv, mask, prompt_index)
    ctx.params = (scale, dropout_p, seed, backend)
    ctx.mark_non_differentiable(lse, kv)


def _backward(ctx, dout, _dlse, _dkv):
    q, k, v, prefix_k, prefix_v, out, lse, kv, mask, prompt_index = ctx.saved_tensors
    scale, dropout_p, seed, backend = ctx.params
    dq, dk, dv, dpk, dpv = torch.ops.fastprompt.prefix_attention_bwd(
        dout, q, k, v, prefix_k, prefix_v, out, lse, kv, mask, prompt_index, scale, dropout_p, seed, backend)
    return dq, dk, dv, dpk, dpv, None, None, None, None, None, None


torch.library.register_autograd("fastprompt::prefix_attention_fwd", _backward, setup_context=_setup_context)

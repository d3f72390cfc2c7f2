"""The fused CPU kernel of :func:`fastprompt.ops.prefix_attention` (``csrc/prefix_attention.cpp``): its
``torch.library`` registration (fake implementations and autograd formula on the C++ ops) and its call.

The kernel reads q, k, v in the layout transformers hands the attention function (``(B, S, H, D)`` buffers
seen as ``(B, H, S, D)``; packed: ``(1, N, H, D)`` seen as ``(1, H, N, D)``), reads the prefix once per
(sequence, head) without expanding or concatenating it, reads grouped-query keys/values in place (never expanded
over the query heads that share them), computes an exact softmax per query row over what the row sees (the
prefix always; the tokens of its sequence within the causal mask / window, with the additive bias), drops
probabilities with the Philox counter generator of the Triton kernels (the same keep decisions for a seed, bit for
bit), and writes its output into a ``(B, S, H, D)`` buffer. It saves only the per-row log-sum-exp; the backward
recomputes the probabilities and regenerates the mask. ``fastprompt::prefix_attention_cpu_fwd`` / ``_bwd`` are
opaque nodes for torch.compile.

Its inner loops are compiled for several x86-64 levels (x86-64-v4 = AVX-512, x86-64-v3 = AVX2 + FMA, baseline);
the best one the CPU supports runs, unless the environment variable ``FASTPROMPT_CPU_ISA`` names another one
(``auto`` = the default): the tests run every level this CPU supports, so what an AVX2-only CPU runs is tested on
an AVX-512 one too. The levels differ only in rounding (fused multiply-adds on v3/v4).

float32 kernel: float16/bfloat16 inputs are computed in float32 (as the aten composite does), float64 stays on
the composite.
"""
from __future__ import annotations

from typing import Optional

import torch

from fastprompt.ops import _cpp

_state = {"registered": False}


def available(q: torch.Tensor) -> bool:
    """Whether the kernel takes ``q``: a CPU tensor of a float type other than float64, extension built."""
    return q.device.type == "cpu" and q.dtype != torch.float64 and _register()


def prefix_attention_cpu(q, k, v, prefix_k, prefix_v, mask: Optional[torch.Tensor],
                         prompt_index: Optional[torch.Tensor], scale: float, dropout_p: float,
                         seed: int | torch.Tensor | None, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
                         attn_bias: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
                         max_seqlen: Optional[int] = None) -> torch.Tensor:
    """The op on validated inputs (``mask`` bool or None, ``prompt_index`` and ``cu_seqlens`` int64 or None;
    ``seed`` an int, a 0-d int64 tensor or None for 0); q's layout and dtype, a transposed (B, S, H, D) buffer
    (packed: (1, N, H, D)) for float32. ``max_seqlen`` None: the longest packed sequence (found by the kernel, so
    a compiled graph needs no host sync)."""
    _require()
    dtype = q.dtype
    args = [_unit_last(x.to(torch.float32)) for x in (q, k, v, prefix_k, prefix_v)]
    mask = None if mask is None else mask.contiguous()
    prompt_index = None if prompt_index is None else prompt_index.contiguous()
    bias = None if attn_bias is None else _unit_last(attn_bias.to(torch.float32))
    cu = None if cu_seqlens is None else cu_seqlens.contiguous()
    if not isinstance(seed, torch.Tensor):
        seed = torch.tensor(signed_seed(0 if seed is None else seed), dtype=torch.int64)
    out, _ = torch.ops.fastprompt.prefix_attention_cpu_fwd(*args, mask, prompt_index, scale, dropout_p, seed,
                                                           bool(causal), int(window[0]), int(window[1]), bias, cu,
                                                           -1 if max_seqlen is None else int(max_seqlen))
    return out.to(dtype)


def keep_mask(B: int, H: int, S: int, P: int, dropout_p: float, seed: int) -> torch.Tensor:
    """The kernel's dropout keep-mask, (B, H, S, P + S) bool (True = kept): the Triton kernels' mask too.

    Entry (b, h, i, j) is the keep decision of query head h, row i of sequence b at column j of the virtual
    [prefix ; tokens]. A packed batch draws the mask of the same sequences right-padded to ``max_seqlen``: pass
    S = max_seqlen (the layout ``prefix_attention_reference``'s ``dropout_mask`` takes for a packed batch)."""
    _require()
    return torch.ops.fastprompt.prefix_attention_cpu_keep_mask(B, H, S, P, float(dropout_p), signed_seed(seed))


def isa() -> str:
    """The x86-64 level the kernel runs now: ``FASTPROMPT_CPU_ISA`` when set (an unknown or unsupported level
    raises), else the best one this CPU supports."""
    _require()
    return torch.ops.fastprompt.prefix_attention_cpu_isa()


def isa_levels() -> list[str]:
    """The levels this build has and this CPU supports, best first (``baseline`` always; one on a non-x86 build)."""
    _require()
    return list(torch.ops.fastprompt.prefix_attention_cpu_isa_levels())


def signed_seed(seed: int) -> int:
    """A seed's 64 bits as a signed int64 (what a tensor or an op schema's int holds)."""
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ------------------------------------------------------------------------------------------------
# registration on the C++ ops (once, when the extension is loaded)


def _require() -> None:
    """Register the ops, or raise why the extension is missing."""
    if not _register():
        raise RuntimeError(_cpp.missing_reason())


def _register() -> bool:
    if _state["registered"]:
        return True
    if not _cpp.available() or not hasattr(torch.ops.fastprompt, "prefix_attention_cpu_fwd"):
        return False
    torch.library.register_fake("fastprompt::prefix_attention_cpu_fwd", _fwd_fake)
    torch.library.register_fake("fastprompt::prefix_attention_cpu_bwd", _bwd_fake)
    torch.library.register_autograd("fastprompt::prefix_attention_cpu_fwd", _backward, setup_context=_setup_context)
    _state["registered"] = True
    return True


def _fwd_fake(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale, dropout_p, seed, causal=False,
              window_left=-1, window_right=-1, attn_bias=None, cu_seqlens=None, max_seqlen=-1):
    B, H, S, D = q.shape
    return q.new_empty((B, S, H, D)).transpose(1, 2), q.new_empty((B, H, S))


def _bwd_fake(dout, q, k, v, prefix_k, prefix_v, lse, key_padding_mask, prompt_index, scale, dropout_p, seed,
              need_dq, need_dkv, need_dprefix, causal=False, window_left=-1, window_right=-1, attn_bias=None,
              cu_seqlens=None, max_seqlen=-1, need_dbias=False):
    def like(x, wanted):
        return torch.empty_like(x) if wanted else q.new_empty((0,))

    dbias = q.new_empty((0,))
    if need_dbias:
        B = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        L = attn_bias.shape[-1]
        dbias = q.new_empty((B, q.shape[1], L, L))
    return (like(q, need_dq), like(k, need_dkv), like(v, need_dkv),
            prefix_k.new_empty(prefix_k.shape) if need_dprefix else q.new_empty((0,)),
            prefix_v.new_empty(prefix_v.shape) if need_dprefix else q.new_empty((0,)), dbias)


def _setup_context(ctx, inputs, output):
    (q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, causal, left, right, bias, cu,
     max_seqlen) = inputs
    _, lse = output
    ctx.save_for_backward(q, k, v, prefix_k, prefix_v, lse, mask, prompt_index, seed, bias, cu)
    ctx.params = (scale, dropout_p, causal, left, right, max_seqlen)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, _dlse):
    n_inputs = 16
    if dout is None:
        return (None,) * n_inputs
    q, k, v, prefix_k, prefix_v, lse, mask, prompt_index, seed, bias, cu = ctx.saved_tensors
    need = ctx.needs_input_grad
    scale, dropout_p, causal, left, right, max_seqlen = ctx.params
    need_dbias = bias is not None and need[13]
    dq, dk, dv, dpk, dpv, dbias = torch.ops.fastprompt.prefix_attention_cpu_bwd(
        dout, q, k, v, prefix_k, prefix_v, lse, mask, prompt_index, scale, dropout_p, seed, need[0],
        need[1] or need[2], need[3] or need[4], causal, left, right, bias, cu, max_seqlen, need_dbias)
    if need_dbias:  # (B, H, L, L) -> the bias's broadcast shape
        dims = [d for d in range(4) if bias.shape[d] == 1 and dbias.shape[d] != 1]
        dbias = dbias.sum(dims, keepdim=True) if dims else dbias
    grads = (dq, dk, dv, dpk, dpv)
    return (tuple(g if n else None for g, n in zip(grads, need[:5])) + (None,) * 8 + (dbias if need_dbias else None,)
            + (None, None))

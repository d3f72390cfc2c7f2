"""Fused prefix attention: every token attends to a trainable prompt prefix and to its own sequence,
without the prefix ever being expanded over the batch or concatenated with the token keys/values.

``prefix_attention(q, k, v, prefix_k, prefix_v, key_padding_mask)`` computes, per example b and head h,
``softmax(q K^T * scale) V`` over the keys ``K = [prefix_k ; k[b]]`` (values likewise), with the prefix
always visible and padded tokens (``key_padding_mask`` False) hidden. The prefix is ``(Hkv, P, D)`` shared
by the batch, or ``(T, Hkv, P, D)`` with ``prompt_index`` (B,) picking each example's prompt (several tasks
in one batch on one frozen backbone). k, v may have fewer heads than q (grouped-query attention, never expanded);
``causal`` and ``window`` restrict the token block (the prefix stays visible to every row), and ``attn_bias`` adds
to the token block's scores. ``prefix_attention_varlen(q, k, v, prefix_k, prefix_v, cu_seqlens, max_seqlen)`` runs
a packed batch (real tokens only, sequences back to back) with the same options and kernels: two public entries,
as FlashAttention's ``flash_attn_func`` and ``flash_attn_varlen_func``, each checking its own arguments.

Backends:

``"triton"``     the kernels of ``fastprompt.kernels.prefix_attention``: one forward launch (online softmax
                 over the prefix tiles then the token tiles), a backward of two (dQ, then dK/dV over the token
                 and prefix key tiles; recomputed from the saved log-sum-exp; prefix gradients are per-program
                 partial sums reduced in a fixed order), and nothing on the way that reads a tensor on the
                 host. On CPU tensors this runs the Triton interpreter (``TRITON_INTERPRET=1`` before the
                 kernels are imported).
``"cpu"``        on CPU tensors of float32/16/bf16, the fused C++ kernel of ``fastprompt._C``
                 (:mod:`fastprompt.ops.attention_cpu`: reads the prefix once per (example, head), never
                 concatenates it, saves only the log-sum-exp, regenerates the dropout mask in the backward;
                 half precision computed in float32). Otherwise (float64, the extension not built, CUDA
                 tensors the Triton kernels do not take: float64 or D > 128) a composite of aten ops that
                 autograd differentiates: SDPA over an on-the-fly concatenation, or eager attention with the
                 seeded mask when dropout is on or the bias needs a gradient.
``"reference"``  :func:`fastprompt.ops.reference.prefix_attention_reference` (explicit concatenation, float32).
``"auto"``       CUDA -> "triton" (when supported), otherwise "cpu" (the rule shared by every op:
                 :func:`fastprompt.backends.resolve_backend`; this op declares :data:`SUPPORT`).

The fused kernels (Triton, and the C++ kernel of "cpu") are one ``torch.library`` custom op with a ``backend``
argument (``fastprompt::prefix_attention_fwd`` / ``_bwd``, fake implementations, a registered autograd formula),
wired as ``fastprompt::contrastive_loss_fwd`` is (``docs/adding-a-kernel.md``), so ``torch.compile`` keeps either
as a single opaque node; the aten composite is traced through (and can be fused) like any aten code. Eagerly the
Triton kernels skip the custom op's dispatch: one ``torch.autograd.Function`` (:class:`_TritonAttention`) calls
their launchers.

Dropout acts on the attention probabilities. Its mask is a pure function of ``seed`` and the position:
the same seed reproduces the same mask exactly (the gradient cache replays forwards). ``seed=None`` with
``dropout_p > 0`` draws the seed from the default generator of q's device, as a 0-d tensor the fused kernels load
(no host read; on CUDA a captured graph draws a new one per replay): restoring ``torch.get_rng_state()`` (CPU
tensors) or ``torch.cuda.get_rng_state()`` (CUDA) replays it. The Triton kernels and the C++ kernel draw the same
Philox mask (bit for bit:
:func:`fastprompt.ops.attention_cpu.keep_mask`), and a packed batch drops what the same sequences right-padded
to ``max_seqlen`` drop; the aten composite and the reference use a seeded ``torch.Generator`` (same contract,
different masks).

A row that sees no key at all (P = 0 and no visible token: an all-padding example, a leading pad row under a
causal mask, a window that reaches no real token) outputs zeros. With P >= 1 every row
sees the prefix, so a fully padded example simply attends to the prompt: finite output, no NaN.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Optional

import torch

from fastprompt.backends import OpSupport, register_op, resolve_backend
from fastprompt.host_sync import checks_stay_on_device
from fastprompt.ops import attention_cpu
from fastprompt.ops.reference import prefix_attention_dropout_mask, prefix_attention_reference

__all__ = ["prefix_attention", "prefix_attention_varlen", "draw_seed", "SUPPORT", "MAX_TRITON_HEAD_DIM"]

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)

#: Largest head dim of the Triton kernels (one (rows x D) tile per operand, D padded to a power of two).
MAX_TRITON_HEAD_DIM = 128


def _triton_limits(q: torch.Tensor) -> Optional[str]:
    D = q.shape[-1]
    return f"head dims up to {MAX_TRITON_HEAD_DIM}, got D = {D}" if D > MAX_TRITON_HEAD_DIM else None


#: What the backends take (the rule that chooses among them: :func:`fastprompt.backends.resolve_backend`).
SUPPORT = register_op(OpSupport(
    name="prefix_attention",
    triton_dtypes=(torch.float16, torch.bfloat16, torch.float32),
    triton_limits=_triton_limits,
    native="the C++ kernel of fastprompt._C (an aten composite for float64 or without the extension)",
    native_devices=None,  # aten ops run on every device: the CUDA fallback for float64 or D > 128
))


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
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    attn_bias: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    max_seqlen: Optional[int] = None,
) -> torch.Tensor:
    """Attention of token queries over ``[prefix ; tokens]`` for a padded batch; returns q's shape ``(B, H, S, D)``
    in q's dtype. A packed batch (real tokens only, back to back) is :func:`prefix_attention_varlen`: the two
    entries share every kernel (FlashAttention's ``flash_attn_func`` / ``flash_attn_varlen_func`` split).

    Args:
        q: ``(B, H, S, D)`` (any strides, e.g. transformers' ``view(...).transpose(1, 2)``).
        k, v: ``(B, Hkv, S, D)`` with ``H % Hkv == 0``: grouped-query / multi-query attention, query head h reads
            key/value head ``h // (H // Hkv)``; never expanded over the group.
        prefix_k, prefix_v: ``(Hkv, P, D)`` shared by the batch, or ``(T, Hkv, P, D)`` with ``prompt_index``.
        key_padding_mask: ``(B, S)``, True (or 1) = real token; None = no padding. Prefix keys are always
            visible.
        scale: score scale, default ``D ** -0.5``.
        dropout_p: dropout probability on the attention probabilities (0 in eval).
        seed: dropout seed (any int, 64 bits used); None draws one from the default generator of q's device.
        prompt_index: ``(B,)`` integer prompt id per example, required with a 4-D prefix.
        backend: "auto", "triton", "cpu" or "reference" (see the module docstring).
        causal: token j is visible to query i only when ``j <= i`` (in-sequence row indices); the prefix stays
            visible to every row.
        window: ``(left, right)``: token j is visible to query i only when ``i - left <= j <= i + right``,
            ``-1`` = unbounded on that side (FlashAttention's ``window_size``; a causal sliding window of W
            tokens is ``causal=True, window=(W - 1, 0)``); the prefix stays visible.
        attn_bias: additive float bias on the token block's scaled scores, ``(1 or B, 1 or H, S, S)``; the prefix
            columns get none. Differentiable when it requires grad (the gradient is summed over its broadcast
            dims).
        cu_seqlens, max_seqlen: the packed form's arguments, for call sites written before the split: given
            ``cu_seqlens``, the call is :func:`prefix_attention_varlen`'s (``key_padding_mask`` must be None). New
            code calls that entry.

    The Triton and C++ kernels return a transposed ``(B, S, H, D)`` buffer, so ``out.transpose(1, 2).reshape(B, S,
    H * D)`` needs no copy (the aten composite returns what SDPA returns: the same layout for such q).
    """
    options = dict(scale=scale, dropout_p=dropout_p, seed=seed, prompt_index=prompt_index, backend=backend,
                   causal=causal, window=window, attn_bias=attn_bias)
    if cu_seqlens is not None:
        if key_padding_mask is not None:
            raise ValueError("a packed batch (cu_seqlens) has no padding: key_padding_mask must be None")
        return prefix_attention_varlen(q, k, v, prefix_k, prefix_v, cu_seqlens, max_seqlen, **options)
    if max_seqlen is not None:
        raise ValueError("max_seqlen is only meaningful with cu_seqlens (a packed batch)")
    B, H, S, _ = _check_tensors(q, k, v, prefix_k, prefix_v)
    _check_prompt_ids(q, prefix_k, prompt_index, B, "example")
    _check_padding_mask(q, key_padding_mask)
    window = _check_options(q, dropout_p, causal, window, attn_bias, B, H, S, "S")
    return _attend(q, k, v, prefix_k, prefix_v, key_padding_mask, None, None, **{**options, "window": window})


def prefix_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: Optional[int] = None,
    *,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    seed: Optional[int] = None,
    prompt_index: Optional[torch.Tensor] = None,
    backend: str = "auto",
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    attn_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`prefix_attention` of a packed batch: the real tokens of B sequences back to back, no padding;
    returns q's shape ``(1, H, N, D)`` in q's dtype. The same kernels, options and backends as the padded entry.

    Args:
        q: ``(1, H, N, D)``: the N = ``cu_seqlens[-1]`` tokens of every sequence (sequence b is rows
            ``cu_seqlens[b]:cu_seqlens[b + 1]``); each attends to its own tokens and its prefix.
        k, v: ``(1, Hkv, N, D)`` with ``H % Hkv == 0`` (grouped-query attention, as the padded entry).
        prefix_k, prefix_v: ``(Hkv, P, D)``, or ``(T, Hkv, P, D)`` with ``prompt_index``.
        cu_seqlens: ``(B + 1,)`` int32/int64 offsets of the sequences.
        max_seqlen: the padded width L the packed batch stands for (the bias's size and the dropout mask's row
            width: a packed batch drops what the same sequences right-padded to L drop); default the longest
            sequence, read from the offsets on the host (on CUDA a device sync, logged once; refused on the Triton
            path under ``torch.compile`` or CUDA-graph capture): pass it.
        prompt_index: ``(B,)`` integer prompt id per sequence, required with a 4-D prefix.
        attn_bias: ``(1 or B, 1 or H, L, L)`` over in-sequence positions.
        scale, dropout_p, seed, backend, causal, window: as :func:`prefix_attention` (``causal`` and ``window``
            over in-sequence positions).

    The Triton and C++ kernels return a transposed ``(1, N, H, D)`` buffer, as the padded entry does.
    """
    _, H, _, _ = _check_tensors(q, k, v, prefix_k, prefix_v)
    n_seq = _check_offsets(q, cu_seqlens, max_seqlen)
    _check_prompt_ids(q, prefix_k, prompt_index, n_seq, "sequence")
    window = _check_options(q, dropout_p, causal, window, attn_bias, n_seq, H, max_seqlen, "L (max_seqlen)")
    return _attend(q, k, v, prefix_k, prefix_v, None, cu_seqlens, max_seqlen, scale=scale, dropout_p=dropout_p,
                   seed=seed, prompt_index=prompt_index, backend=backend, causal=causal, window=window,
                   attn_bias=attn_bias)


def _attend(q, k, v, prefix_k, prefix_v, key_padding_mask, cu_seqlens, max_seqlen, *, scale, dropout_p, seed,
            prompt_index, backend, causal, window, attn_bias) -> torch.Tensor:
    """The kernels both entries share, on validated arguments (``cu_seqlens`` None: a padded batch)."""
    resolved = resolve_backend(SUPPORT, q, backend)  # before a seed is drawn: a bad backend consumes no RNG
    if backend == "auto" and resolved == "triton" and q.is_cuda:
        resolved = _measured_auto(q, k, prefix_k, dropout_p, attn_bias, cu_seqlens, max_seqlen)
    fused = resolved == "triton" or (resolved == "cpu" and attention_cpu.available(q))
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    if prompt_index is not None:
        prompt_index = prompt_index.to(torch.long)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.long)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dropout_p = float(dropout_p)
    if dropout_p > 0 and seed is None:
        # The fused kernels take the seed as a tensor that they load: no host read, so torch.compile does not
        # break the graph here, and on CUDA it is drawn on q's device by its default generator (graph-safe: a
        # captured CUDA graph draws a new seed per replay). On CPU tensors: the default CPU generator.
        seed = _draw_seed_tensor(q.device) if fused else draw_seed()
    # The values of prompt_index and cu_seqlens: checked here, once, for every backend (without a host sync on
    # CUDA or under torch.compile); in a compiled graph the C++ kernel checks them itself (no extra nodes).
    if not (fused and resolved == "cpu" and torch.compiler.is_compiling()):
        _check_prompt_index(prompt_index, prefix_k.shape[0])
        if cu_seqlens is not None:
            max_seqlen = _check_packed(cu_seqlens, q.shape[2], max_seqlen, attn_bias, triton=resolved == "triton")
    features = dict(causal=bool(causal), window=window, attn_bias=attn_bias, cu_seqlens=cu_seqlens,
                    max_seqlen=max_seqlen)
    if fused:
        return _kernel_attention(resolved, q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed,
                                 **features)
    seed = 0 if seed is None else int(seed)
    if resolved == "reference":
        return prefix_attention_reference(q, k, v, prefix_k, prefix_v, mask, scale=scale, dropout_p=dropout_p,
                                          seed=seed, prompt_index=prompt_index, **features)
    return _cpu_attention(q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, **features)


#: auto's decisions on CUDA, once per (device, shape class): {key: backend}
_AUTO_CHOICES: dict = {}


def _measured_auto(q, k, prefix_k, dropout_p, attn_bias, cu_seqlens, max_seqlen) -> str:
    """``auto`` on CUDA: the Triton kernels, or the plain path ("cpu": SDPA on the concatenated prefix) where this
    GPU's tuned table measured the plain path faster at this shape class (:mod:`fastprompt.kernels.tuning`; it
    keeps the maths: the composite takes every option the kernels take) and it fits in the free memory. Decided and
    logged once per shape class."""
    from fastprompt.kernels import tuning

    B, H, S, D = q.shape
    packed = cu_seqlens is not None
    width = int(max_seqlen) if packed and max_seqlen is not None else S
    seqs = cu_seqlens.numel() - 1 if packed else B
    tag = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(q.dtype, "fp32")
    key = {"dtype": tag, "D": D, "P": prefix_k.shape[-2], "S": width, "BH": seqs * H,
           "grad": torch.is_grad_enabled() and q.requires_grad, "dropout": float(dropout_p) > 0}
    memo = (q.device, tuple(sorted(key.items())))
    if memo in _AUTO_CHOICES:
        return _AUTO_CHOICES[memo]
    choice = tuning.measured_choice("prefix_attention", key, q.device)
    backend, why = "triton", "no measurement of this GPU near this shape (the fused kernels)"
    if choice is not None and choice.backend == "plain":
        need = _plain_bytes(seqs, H, k.shape[1], width, prefix_k.shape[-2], D, q.element_size(), dropout_p > 0
                            or (attn_bias is not None and attn_bias.requires_grad))
        free = torch.cuda.mem_get_info(q.device)[0]
        if need <= free // 2:
            backend = "cpu"
            why = (f"the plain path (SDPA on the concatenated prefix) measured faster here: {choice.ms}, "
                   f"{choice.source}")
        else:
            why = (f"the plain path measured faster here ({choice.ms}), but it needs ~{need / 2**30:.2f} GiB and "
                   f"{free / 2**30:.2f} GiB are free: the fused kernels")
    elif choice is not None:
        why = f"the fused kernels measured faster here: {choice.ms}, {choice.source}"
    logger.info("prefix_attention auto on %s at %s: %s", torch.cuda.get_device_name(q.device), key, why)
    _AUTO_CHOICES[memo] = backend
    return backend


def _plain_bytes(B: int, H: int, Hkv: int, S: int, P: int, D: int, itemsize: int, eager: bool) -> int:
    """The plain path's extra memory: the concatenated keys and values and the visibility mask; with dropout (or a
    bias gradient) eager attention's probabilities, scores and mask too (float32)."""
    concat = 2 * B * Hkv * (P + S) * D * itemsize + B * S * (P + S)
    return concat + (3 * B * H * S * (P + S) * 4 if eager else 0)


def draw_seed() -> int:
    """A fresh 63-bit dropout seed from torch's default CPU generator (replayable via its RNG state)."""
    return int(_draw_seed_tensor().item())  # host read: a CPU tensor (the CPU generator's draw)


def _draw_seed_tensor(device=None) -> torch.Tensor:
    """The draw of :func:`draw_seed`, left as a 0-d int64 tensor on ``device`` (default CPU), drawn there by its
    default generator (no host read: on CUDA it is recorded and replayed by its RNG state, and CUDA graphs
    capture it)."""
    return torch.randint(0, 2**63 - 1, (), dtype=torch.int64, device=device)


def _sync_free(x: torch.Tensor) -> bool:
    """Whether the value checks must not read ``x`` on the host: a CUDA tensor (a read waits for the GPU),
    torch.compile tracing, or :func:`fastprompt.host_sync.sync_free` (the CPU tests of the CUDA path's host code).
    Elsewhere (CPU tensors) they read it and raise a clear ValueError."""
    return checks_stay_on_device(x)


def _check_tensors(q, k, v, prefix_k, prefix_v) -> tuple[int, int, int, int]:
    """The five tensors of both entries: floating, of q's dtype and device, with agreeing shapes (grouped-query
    heads, a prefix per key/value head). Returns q's (B, H, S, D). Checks without reading tensor values, as every
    ``_check_*`` below but :func:`_check_prompt_index` and :func:`_check_packed`."""
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
    B, H, S, D = q.shape
    if min(B, H, S, D) < 1:
        raise ValueError(f"q must have B, H, S, D >= 1, got shape {tuple(q.shape)}")
    if k.dim() != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[2:] != q.shape[2:] or k.shape[1] < 1:
        raise ValueError(f"k and v must have the same (B, Hkv, S, D) shape, with q's B, S, D: ({B}, Hkv, {S}, {D}); "
                         f"got {tuple(k.shape)}, {tuple(v.shape)}")
    Hkv = k.shape[1]
    if H % Hkv:
        raise ValueError(f"q's {H} heads must be a multiple of k and v's {Hkv} heads (grouped-query attention: "
                         f"query head h reads key/value head h // (H // Hkv))")
    if prefix_k.shape != prefix_v.shape:
        raise ValueError(f"prefix_k {tuple(prefix_k.shape)} and prefix_v {tuple(prefix_v.shape)} differ in shape")
    if prefix_k.dim() not in (3, 4) or prefix_k.shape[-3] != Hkv or prefix_k.shape[-1] != D:
        raise ValueError(f"prefix_k must be (Hkv, P, D) = ({Hkv}, P, {D}) or (T, {Hkv}, P, {D}) (one prefix per "
                         f"key/value head), got {tuple(prefix_k.shape)}")
    return B, H, S, D


def _check_offsets(q, cu_seqlens, max_seqlen) -> int:
    """A packed batch's offsets and width (their values: :func:`_check_packed`); returns its number of sequences."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or \
            cu_seqlens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"cu_seqlens must be a (B + 1,) int32/int64 tensor of sequence offsets, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} "
                         f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if q.shape[0] != 1:
        raise ValueError(f"a packed batch (cu_seqlens) is q (1, H, N, D) holding every sequence's tokens back to "
                         f"back, got q {tuple(q.shape)}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1):
        raise ValueError(f"max_seqlen must be a positive int, got {max_seqlen!r}")
    return cu_seqlens.numel() - 1


def _check_prompt_ids(q, prefix_k, prompt_index, n_seq: int, per: str) -> None:
    """A 4-D prefix needs one prompt id ``per`` example (padded) or sequence (packed); a 3-D one takes none."""
    if prefix_k.dim() == 4:
        if prompt_index is None:
            raise ValueError("a (T, Hkv, P, D) prefix needs prompt_index (B,) choosing each example's prompt")
        if not isinstance(prompt_index, torch.Tensor) or prompt_index.shape != (n_seq,) or \
                prompt_index.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"prompt_index must be an int64/int32 tensor of shape ({n_seq},) (one per {per}), got "
                             f"{getattr(prompt_index, 'dtype', type(prompt_index))} "
                             f"{tuple(getattr(prompt_index, 'shape', ()))}")
        if prompt_index.device != q.device:
            raise ValueError(f"prompt_index is on {prompt_index.device} but q is on {q.device}")
        if prefix_k.shape[0] == 0:
            raise ValueError("a (T, Hkv, P, D) prefix needs T >= 1 prompts")
    elif prompt_index is not None:
        raise ValueError("prompt_index is only meaningful with a (T, Hkv, P, D) prefix; got an (Hkv, P, D) prefix")


def _check_padding_mask(q, key_padding_mask) -> None:
    if key_padding_mask is None:
        return
    B, _, S, _ = q.shape
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.shape != (B, S):
        raise ValueError(f"key_padding_mask must be a (B, S) = ({B}, {S}) tensor, got "
                         f"{tuple(getattr(key_padding_mask, 'shape', ()))}")
    if key_padding_mask.is_floating_point() or key_padding_mask.is_complex():
        raise ValueError(f"key_padding_mask must be bool (True = real token) or 0/1 integers, "
                         f"got {key_padding_mask.dtype}")
    if key_padding_mask.device != q.device:
        raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")


def _check_options(q, dropout_p, causal, window, attn_bias, n_seq: int, H: int, L: Optional[int],
                   width: str) -> tuple[int, int]:
    """Dropout, the masks and the bias (``(1 or n_seq, 1 or H, L, L)``, L named ``width`` in messages; None:
    not known yet, a packed batch without max_seqlen). Returns the window as a tuple of two ints."""
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if not isinstance(window, (tuple, list)) or len(window) != 2 or \
            any(isinstance(w, bool) or not isinstance(w, int) for w in window):
        raise ValueError(f"window must be a pair of ints (left, right), -1 = unbounded, got {window!r}")
    if min(window) < -1:
        raise ValueError(f"window sizes must be >= 0, or -1 for unbounded, got {tuple(window)}")
    if attn_bias is not None:
        if not isinstance(attn_bias, torch.Tensor) or not attn_bias.is_floating_point():
            raise ValueError(f"attn_bias must be a floating-point tensor, got "
                             f"{getattr(attn_bias, 'dtype', type(attn_bias))}")
        if attn_bias.device != q.device:
            raise ValueError(f"attn_bias is on {attn_bias.device} but q is on {q.device}")
        if attn_bias.dim() != 4 or attn_bias.shape[0] not in (1, n_seq) or attn_bias.shape[1] not in (1, H) or \
                attn_bias.shape[2] != attn_bias.shape[3] or (L is not None and attn_bias.shape[2] != L):
            raise ValueError(f"attn_bias must be (1 or B, 1 or H, {width}, {width}) = (1 or {n_seq}, 1 or {H}, "
                             f"{L or 'L'}, {L or 'L'}), got {tuple(attn_bias.shape)}")
    return int(window[0]), int(window[1])


def _check_prompt_index(prompt_index: Optional[torch.Tensor], T: int) -> None:
    """Out-of-range prompt ids would read out of bounds in the kernels (checked without a host sync on CUDA or
    under torch.compile)."""
    if prompt_index is None:
        return
    if _sync_free(prompt_index):
        if not _checked_before(prompt_index, ("prompt_index", T)):
            torch._assert_async(((prompt_index >= 0) & (prompt_index < T)).all(), f"prompt_index out of range [0, {T})")
        return
    bad = ((prompt_index < 0) | (prompt_index >= T)).any()
    if bool(bad):  # host read: a CPU tensor (this branch never runs on CUDA)
        lo, hi = int(prompt_index.min()), int(prompt_index.max())  # host read: a CPU tensor, for the message
        raise ValueError(f"prompt_index values must be in [0, {T}), got min {lo}, max {hi}")


def _check_packed(cu_seqlens: torch.Tensor, n_tokens: int, max_seqlen: Optional[int],
                  attn_bias: Optional[torch.Tensor], triton: bool = False) -> int:
    """The one check of a packed batch's offsets (int64): from 0 to N, non-decreasing, no sequence over
    ``max_seqlen``, a bias as wide as the padded width. Returns that width L: ``max_seqlen``, or the longest
    sequence (read on the host: pass ``max_seqlen`` to avoid the sync; the model passes the collator's host-side
    value). Offsets that break these rules would read or write out of bounds in the kernels; on CUDA or under
    torch.compile the check is an asynchronous assert.

    For the Triton kernels (``triton``) a missing ``max_seqlen`` is an error under torch.compile or CUDA-graph
    capture (finding it reads the offsets on the host), and on CUDA otherwise a fallback logged once."""
    if max_seqlen is None:
        if triton and (torch.compiler.is_compiling()
                       or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing())):
            raise ValueError("prefix_attention with cu_seqlens needs max_seqlen under torch.compile or CUDA-graph "
                             "capture: finding the longest sequence reads the offsets on the host")
        if cu_seqlens.is_cuda:
            _warn_once("prefix_attention: cu_seqlens without max_seqlen; reading the longest sequence on the host "
                       "(a device sync per call): pass max_seqlen (the collator's padded width)")
        L = max(1, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()))  # host read: the documented fallback (logged)
    else:
        L = max_seqlen
    if _sync_free(cu_seqlens):
        if not _checked_before(cu_seqlens, ("cu_seqlens", n_tokens, L)):
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == n_tokens) & ((lengths >= 0) & (lengths <= L)).all()
            torch._assert_async(ok, f"cu_seqlens must rise from 0 to the {n_tokens} packed rows, with no sequence "
                                    f"longer than max_seqlen = {L}")
        return _check_bias_width(attn_bias, L)
    offsets = [int(x) for x in cu_seqlens.tolist()]  # host read: a CPU tensor (this branch never runs on CUDA)
    if offsets[0] != 0 or offsets[-1] != n_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the N = {n_tokens} packed tokens of q, got "
                         f"{offsets[0]} ... {offsets[-1]}")
    sizes = [e - s for s, e in zip(offsets[:-1], offsets[1:])]
    if min(sizes) < 0:
        b = min(range(len(sizes)), key=sizes.__getitem__)
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{b}] = {offsets[b]} > "
                         f"cu_seqlens[{b + 1}] = {offsets[b + 1]}")
    if max(sizes) > L:
        b = sizes.index(max(sizes))
        raise ValueError(f"sequence {b} has {sizes[b]} tokens, more than max_seqlen = {L}")
    return _check_bias_width(attn_bias, L)


#: The tensors whose values passed a device-side check: ``{id: (weakref, version, what was checked)}``.
_CHECKED: dict = {}


def _checked_before(t: torch.Tensor, key: tuple) -> bool:
    """Whether this very tensor, unchanged since (its version counter), already passed the check ``key``; records
    it otherwise. The model passes the same offsets and prompt ids to every layer: one check per batch (a handful
    of small kernels) instead of one per layer. Always False under torch.compile (the graph keeps its checks)."""
    if torch.compiler.is_compiling():
        return False
    entry = _CHECKED.get(id(t))
    if entry is not None and entry[0]() is t and entry[1:] == (t._version, key):
        return True
    if len(_CHECKED) > 64:  # entries of tensors long gone
        _CHECKED.clear()
    _CHECKED[id(t)] = (weakref.ref(t), t._version, key)
    return False


def _check_bias_width(attn_bias: Optional[torch.Tensor], L: int) -> int:
    if attn_bias is not None and attn_bias.shape[-1] != L:
        raise ValueError(f"attn_bias must be (1 or B, 1 or H, L, L) with L = {L} (max_seqlen, default the longest "
                         f"sequence), got {tuple(attn_bias.shape)}")
    return L


# ------------------------------------------------------------------------------------------------
# the "cpu" backend: a composite of differentiable aten ops


def _cpu_compute_dtype(dtype, device=None):
    # Half precision is computed in float32 on the CPU: no speed to gain there, and the prefix gradients sum
    # B * S products, which half-precision partials would round visibly. On a GPU the composite is auto's plain
    # path: SDPA in the input's dtype, as it was measured against the kernels.
    if getattr(device, "type", "cpu") != "cpu":
        return dtype
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _cpu_attention(q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, causal=False,
                   window=(-1, -1), attn_bias=None, cu_seqlens=None, max_seqlen=None):
    """SDPA (the fused CPU flash-attention kernel forward and backward) over an on-the-fly concatenation
    without dropout or a bias gradient; otherwise eager attention (its dropout mask from the seed). Grouped
    key/value heads are broadcast over their query heads, not copied; a packed batch is unpacked to right-padded
    rows of width ``max_seqlen`` and repacked. Autograd differentiates it. The "cpu" backend's path where the C++
    kernel does not run (float64, no extension, CUDA fallback)."""
    if cu_seqlens is not None:
        packing = _Packing(cu_seqlens, max_seqlen, q.shape[2])  # max_seqlen: _check_packed's width
        out = _cpu_attention(*(packing.unpack(x) for x in (q, k, v)), prefix_k, prefix_v, packing.mask, prompt_index,
                             scale, dropout_p, seed, causal, window, attn_bias)
        return packing.repack(out)
    B, H, S, D = q.shape
    Hkv, P = k.shape[1], prefix_k.shape[-2]
    cd = _cpu_compute_dtype(q.dtype, q.device)
    if prefix_k.dim() == 3:
        pk, pv = (p.unsqueeze(0).expand(B, -1, -1, -1) for p in (prefix_k, prefix_v))
    else:
        pk, pv = prefix_k[prompt_index], prefix_v[prompt_index]
    keys = torch.cat([pk, k], 2).to(cd)
    values = torch.cat([pv, v], 2).to(cd)
    qc = q.to(cd)
    visible = _visible(mask, S, P, causal, window, q.device)
    empty = None
    if visible is not None and P == 0:  # a row that sees no key: unmask one for a finite softmax, zero it below
        empty = ~visible.any(-1, keepdim=True)
        visible = visible.clone()
        visible[..., :1] |= empty
    bias = None if attn_bias is None else torch.nn.functional.pad(attn_bias.to(cd), (P, 0))  # prefix columns: 0
    if dropout_p == 0 and (bias is None or not bias.requires_grad):
        attn_mask = visible
        if bias is not None:
            attn_mask = bias if visible is None else bias.masked_fill(~visible, float("-inf"))
        out = torch.nn.functional.scaled_dot_product_attention(qc, keys, values, attn_mask=attn_mask, scale=scale,
                                                               enable_gqa=Hkv != H)
    else:
        group = H // Hkv  # (B, Hkv, group, S, D) queries against (B, Hkv, 1, P + S, D) keys: broadcast, no copy
        scores = torch.matmul(qc.unflatten(1, (Hkv, group)), keys.unsqueeze(2).transpose(-1, -2)).flatten(1, 2)
        scores = scores * scale
        if bias is not None:
            scores = scores + bias
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, -1)
        if dropout_p > 0:
            probs = probs * torch.ops.fastprompt.seeded_dropout_scale(probs.detach(), seed, dropout_p)
        out = torch.matmul(probs.unflatten(1, (Hkv, group)), values.unsqueeze(2)).flatten(1, 2)
    if empty is not None:
        out = out.masked_fill(empty, 0.0)
    return out.to(q.dtype)


def _visible(mask, S, P, causal, window, device) -> Optional[torch.Tensor]:
    """Which keys of ``[prefix ; tokens]`` each query row sees, (B or 1, 1, S, P + S) bool; None: all of them."""
    i = torch.arange(S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    left, right = window
    tokens = None
    for on, allowed in ((causal, lambda: j <= i), (left >= 0, lambda: j >= i - left),
                        (right >= 0, lambda: j <= i + right)):
        if on:
            tokens = allowed() if tokens is None else tokens & allowed()
    if tokens is None and mask is None:
        return None
    tokens = torch.ones(1, 1, 1, S, dtype=torch.bool, device=device) if tokens is None else tokens[None, None]
    if mask is not None:
        tokens = tokens & mask[:, None, None, :]
    tokens = tokens.expand(tokens.shape[0], 1, S, S)
    return torch.cat([tokens.new_ones(tokens.shape[0], 1, S, P), tokens], -1)


class _Packing:
    """A packed batch (rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of N) as right-padded rows of width L, and back;
    index gathers that autograd differentiates, built without a host sync."""

    def __init__(self, cu_seqlens: torch.Tensor, L: int, N: int):
        starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        self.B, self.L = starts.numel(), L
        pos = torch.arange(L, device=cu_seqlens.device)
        self.mask = pos[None, :] < lengths[:, None]  # (B, L), True = a real token
        self.src = torch.where(self.mask, starts[:, None] + pos[None, :], N).flatten()  # row N: zeros
        seq = torch.repeat_interleave(torch.arange(self.B, device=cu_seqlens.device), lengths, output_size=N)
        self.dst = seq * L + torch.arange(N, device=cu_seqlens.device) - starts[seq]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, heads, N, D) -> (B, heads, L, D), zeros after each sequence."""
        rows = torch.nn.functional.pad(x[0], (0, 0, 0, 1))
        return rows.index_select(1, self.src).unflatten(1, (self.B, self.L)).transpose(0, 1)

    def repack(self, y: torch.Tensor) -> torch.Tensor:
        """(B, heads, L, D) -> (1, heads, N, D)."""
        return y.transpose(0, 1).flatten(1, 2).index_select(1, self.dst).unsqueeze(0)


@torch.library.custom_op("fastprompt::seeded_dropout_scale", mutates_args=())
def _seeded_dropout_scale(like: torch.Tensor, seed: int, dropout_p: float) -> torch.Tensor:
    """keep / (1 - p) with the CPU/reference keep-mask of ``like``'s shape, in ``like``'s dtype. An op, so
    that torch.compile does not trace the seeded torch.Generator it creates."""
    keep = prefix_attention_dropout_mask(seed, like.shape, dropout_p, like.device)
    return keep.to(like.dtype).mul_(1.0 / (1.0 - dropout_p))


@_seeded_dropout_scale.register_fake
def _seeded_dropout_scale_fake(like, seed, dropout_p):
    return torch.empty_like(like, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------------
# the fused kernels ("triton", and "cpu" where the C++ kernel takes the input): one torch.library custom op with a
# backend argument (forward + registered backward, fake implementations), wired as fastprompt::contrastive_loss_fwd


def _kernel_attention(backend, q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, *,
                      causal=False, window=(-1, -1), attn_bias=None, cu_seqlens=None, max_seqlen=None):
    """The output of :func:`prefix_attention` through the fused kernels on checked inputs (``mask`` bool or None,
    ``prompt_index`` and ``cu_seqlens`` int64 or None, ``seed`` an int, a 0-d int64 tensor or None for 0).
    ``max_seqlen`` None with ``cu_seqlens``: only on the C++ kernel, which finds the longest sequence itself.

    The Triton kernels run eagerly through one ``autograd.Function`` (:class:`_TritonAttention`: the launchers
    called directly, no custom-op dispatch), and through the ``torch.library`` custom op pair under torch.compile
    (one opaque node). The C++ kernel always goes through the custom op."""
    if backend == "triton" and not torch.compiler.is_compiling():
        if dropout_p == 0:
            seed = None
        elif seed is None:
            seed = 0
        return _TritonAttention.apply(q, k, v, prefix_k, prefix_v, attn_bias, mask, prompt_index, cu_seqlens, seed,
                                      (scale, dropout_p, max_seqlen, causal, (int(window[0]), int(window[1]))))
    dtype = q.dtype
    if backend == "cpu":  # the C++ kernel computes in float32 and reads rows with unit stride
        q, k, v, prefix_k, prefix_v = (_unit_last(x.to(torch.float32)) for x in (q, k, v, prefix_k, prefix_v))
        mask, prompt_index, cu_seqlens = (None if x is None else x.contiguous() for x in (mask, prompt_index,
                                                                                         cu_seqlens))
        attn_bias = None if attn_bias is None else _unit_last(attn_bias.to(torch.float32))
        if not isinstance(seed, torch.Tensor):
            seed = torch.tensor(attention_cpu.signed_seed(0 if seed is None else seed), dtype=torch.int64)
    elif not isinstance(seed, torch.Tensor):  # the Triton kernels load it on q's device
        seed = torch.full((), attention_cpu.signed_seed(0 if seed is None else seed), dtype=torch.int64,
                          device=q.device)
    out, _ = torch.ops.fastprompt.prefix_attention_fwd(
        q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, attn_bias, cu_seqlens,
        0 if max_seqlen is None else int(max_seqlen), causal, int(window[0]), int(window[1]), backend)
    return out.to(dtype)


def _kernels():
    from fastprompt.kernels import prefix_attention as kernels

    return kernels


class _TritonAttention(torch.autograd.Function):
    """The Triton kernels' forward and backward, eagerly: one launch forward, two backward, nothing between them
    that reads a tensor on the host. ``seed``: None (no dropout), an int or a 0-d int64 tensor the kernels load;
    ``params``: (scale, dropout_p, max_seqlen, causal, window)."""

    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, attn_bias, mask, prompt_index, cu_seqlens, seed, params):
        scale, dropout_p, max_seqlen, causal, window = params
        out, lse = _kernels().forward(q, k, v, prefix_k, prefix_v, mask, prompt_index, scale=scale,
                                      dropout_p=dropout_p, seed=seed, causal=causal, window=window,
                                      attn_bias=attn_bias, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        seed_t = seed if isinstance(seed, torch.Tensor) else None
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, attn_bias, mask, prompt_index, cu_seqlens, seed_t, out,
                              lse)
        ctx.seed = None if seed_t is not None else seed
        ctx.params = params
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, prefix_k, prefix_v, attn_bias, mask, prompt_index, cu_seqlens, seed, out, lse = ctx.saved_tensors
        scale, dropout_p, max_seqlen, causal, window = ctx.params
        need = ctx.needs_input_grad
        dq, dk, dv, dpk, dpv, dbias = _kernels().backward(
            dout, q, k, v, prefix_k, prefix_v, out, lse, mask, prompt_index, scale=scale, dropout_p=dropout_p,
            seed=ctx.seed if seed is None else seed, causal=causal, window=window, attn_bias=attn_bias,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, bias_grad=attn_bias is not None and need[5])
        grads = [g if wanted else None for g, wanted in zip((dq, dk, dv, dpk, dpv, dbias), need)]
        return (*grads, None, None, None, None, None)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@torch.library.custom_op("fastprompt::prefix_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
            key_padding_mask: Optional[torch.Tensor], prompt_index: Optional[torch.Tensor], scale: float,
            dropout_p: float, seed: torch.Tensor, attn_bias: Optional[torch.Tensor] = None,
            cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: int = 0, causal: bool = False,
            window_left: int = -1, window_right: int = -1,
            backend: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of the fused kernels: out in q's shape (B, H, S, D), or (1, H, N, D) packed, in a transposed
    (B, S, H, D) buffer, and lse (B, H, S) / (1, H, N) float32. ``seed``: a 0-d int64 tensor (the seed's 64 bits,
    signed). ``max_seqlen`` (packed only) bounds every sequence; 0 lets the C++ kernel find it (the Triton
    kernels need it). ``backend``: "triton" (the inputs in any float dtype they take) or "cpu" (the C++ kernel:
    float32 CPU tensors with unit last stride)."""
    if backend == "cpu":
        return torch.ops.fastprompt.prefix_attention_cpu_fwd(
            q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale, dropout_p, seed, causal, window_left,
            window_right, attn_bias, cu_seqlens, max_seqlen if max_seqlen > 0 else -1)
    if cu_seqlens is not None and max_seqlen < 1:
        raise ValueError("the Triton kernels need max_seqlen with cu_seqlens (prefix_attention finds it)")
    return _kernels().forward(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale=scale,
                              dropout_p=dropout_p, seed=seed, causal=causal, window=(window_left, window_right),
                              attn_bias=attn_bias, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, scale, dropout_p, seed, attn_bias=None,
              cu_seqlens=None, max_seqlen=0, causal=False, window_left=-1, window_right=-1, backend="triton"):
    B, H, S, D = q.shape
    return q.new_empty((B, S, H, D)).transpose(1, 2), q.new_empty((B, H, S), dtype=torch.float32)


@torch.library.custom_op("fastprompt::prefix_attention_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor,
            prefix_v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
            prompt_index: Optional[torch.Tensor], scale: float, dropout_p: float, seed: torch.Tensor,
            attn_bias: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: int = 0,
            causal: bool = False, window_left: int = -1, window_right: int = -1, bias_grad: bool = False,
            backend: str = "triton", need_dq: bool = True, need_dkv: bool = True, need_dprefix: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the fused kernels: dq, dk, dv (like ``torch.empty_like`` of q, k, v), dprefix_k, dprefix_v
    (contiguous), and with ``bias_grad`` dattn_bias (attn_bias' shape and dtype); a gradient not asked for
    (``need_*``, ``bias_grad``) is an empty tensor. The C++ kernel skips the work of those; the Triton kernels
    compute them all."""
    if backend == "cpu":
        dq, dk, dv, dpk, dpv, dbias = torch.ops.fastprompt.prefix_attention_cpu_bwd(
            dout, q, k, v, prefix_k, prefix_v, lse, key_padding_mask, prompt_index, scale, dropout_p, seed, need_dq,
            need_dkv, need_dprefix, causal, window_left, window_right, attn_bias, cu_seqlens,
            max_seqlen if max_seqlen > 0 else -1, bias_grad)
        if bias_grad:  # (B, H, L, L) -> the bias's broadcast shape
            dims = [d for d in range(4) if attn_bias.shape[d] == 1 and dbias.shape[d] != 1]
            dbias = dbias.sum(dims, keepdim=True) if dims else dbias
        return dq, dk, dv, dpk, dpv, dbias
    dq, dk, dv, dpk, dpv, dbias = _kernels().backward(
        dout, q, k, v, prefix_k, prefix_v, out, lse, key_padding_mask, prompt_index, scale=scale, dropout_p=dropout_p,
        seed=seed, causal=causal, window=(window_left, window_right), attn_bias=attn_bias, cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen, bias_grad=bias_grad)
    empty = lambda: q.new_empty((0,))  # noqa: E731  (distinct: the outputs must not alias)
    # dprefix_k and dprefix_v are views of one buffer: a custom op's outputs must not alias, so one is copied
    return (_like(dq, q) if need_dq else empty(), _like(dk, k) if need_dkv else empty(),
            _like(dv, v) if need_dkv else empty(), dpk.contiguous() if need_dprefix else empty(),
            dpv.clone() if need_dprefix else empty(), empty() if dbias is None else dbias.contiguous())


@_bwd_op.register_fake
def _bwd_fake(dout, q, k, v, prefix_k, prefix_v, out, lse, key_padding_mask, prompt_index, scale, dropout_p, seed,
              attn_bias=None, cu_seqlens=None, max_seqlen=0, causal=False, window_left=-1, window_right=-1,
              bias_grad=False, backend="triton", need_dq=True, need_dkv=True, need_dprefix=True):
    def grad(x, wanted, like):  # distinct empties: the outputs must not alias
        return like(x) if wanted else q.new_empty((0,))

    qkv, prefix = torch.empty_like, (lambda x: x.new_empty(x.shape))
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_grad and attn_bias is not None else q.new_empty((0,))
    return (grad(q, need_dq, qkv), grad(k, need_dkv, qkv), grad(v, need_dkv, qkv), grad(prefix_k, need_dprefix, prefix),
            grad(prefix_v, need_dprefix, prefix), dbias)


def _like(grad: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """grad with the strides ``torch.empty_like(ref)`` has (what the fake implementation promises). The
    kernels allocate their gradients with empty_like already; this only copies for a non-dense input."""
    if grad.dtype == ref.dtype and grad.stride() == ref.stride() and grad.storage_offset() == 0 and _dense(ref):
        return grad
    return torch.empty_like(ref).copy_(grad)


def _dense(x: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of x is contiguous (then empty_like keeps x's strides)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


_BIAS_INPUT = 10  # attn_bias' position among the forward op's inputs
_DEFAULTS = [None, None, 0, False, -1, -1, "triton"]  # the forward op's arguments after seed


def _setup_context(ctx, inputs, output):
    q, k, v, prefix_k, prefix_v, mask, prompt_index, scale, dropout_p, seed, *rest = inputs
    attn_bias, cu_seqlens, max_seqlen, causal, window_left, window_right, backend = rest + _DEFAULTS[len(rest):]
    out, lse = output
    ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse, mask, prompt_index, seed, attn_bias, cu_seqlens)
    ctx.params = (scale, dropout_p, max_seqlen, causal, window_left, window_right, backend)
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # no zero-filled gradient for lse


def _backward(ctx, dout, _dlse):
    none = (None,) * ctx.n_inputs
    if dout is None:
        return none
    q, k, v, prefix_k, prefix_v, out, lse, mask, prompt_index, seed, attn_bias, cu_seqlens = ctx.saved_tensors
    scale, dropout_p, max_seqlen, causal, window_left, window_right, backend = ctx.params
    need = ctx.needs_input_grad
    bias_grad = attn_bias is not None and need[_BIAS_INPUT]
    grads = torch.ops.fastprompt.prefix_attention_bwd(
        dout, q, k, v, prefix_k, prefix_v, out, lse, mask, prompt_index, scale, dropout_p, seed, attn_bias,
        cu_seqlens, max_seqlen, causal, window_left, window_right, bias_grad, backend, need[0], need[1] or need[2],
        need[3] or need[4])
    result = [g if wanted else None for g, wanted in zip(grads[:5], need[:5])] + [None] * (ctx.n_inputs - 5)
    if bias_grad:
        result[_BIAS_INPUT] = grads[5]
    return tuple(result)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)

"""The fused CPU kernel of :func:`fastprompt.ops.prefix_attention` (``csrc/prefix_attention.cpp``): whether it
runs here, its dropout mask, its ISA levels. It is wired into the op like the Triton kernels, inside
:mod:`fastprompt.ops.attention`'s ``fastprompt::prefix_attention_fwd`` / ``_bwd`` (``backend="cpu"``).

The kernel reads q, k, v in the layout transformers hands the attention function (``(B, S, H, D)`` buffers
seen as ``(B, H, S, D)``; packed: ``(1, N, H, D)`` seen as ``(1, H, N, D)``), reads the prefix once per
(sequence, head) without expanding or concatenating it, reads grouped-query keys/values in place (never expanded
over the query heads that share them), computes an exact softmax per query row over what the row sees (the
prefix always; the tokens of its sequence within the causal mask / window, with the additive bias), drops
probabilities with the Philox counter generator of the Triton kernels (the same keep decisions for a seed, bit for
bit), and writes its output into a ``(B, S, H, D)`` buffer. It saves only the per-row log-sum-exp; the backward
recomputes the probabilities and regenerates the mask. The raw kernels ``fastprompt::prefix_attention_cpu_fwd`` /
``_bwd`` (defined in C++) know nothing of autograd.

Its inner loops are compiled for several x86-64 levels (x86-64-v4 = AVX-512, x86-64-v3 = AVX2 + FMA, baseline);
the best one the CPU supports runs, unless the environment variable ``FASTPROMPT_CPU_ISA`` names another one
(``auto`` = the default): the tests run every level this CPU supports, so what an AVX2-only CPU runs is tested on
an AVX-512 one too. The levels differ only in rounding (fused multiply-adds on v3/v4).

float32 kernel: float16/bfloat16 inputs are computed in float32 (as the aten composite does), float64 stays on
the composite.
"""
from __future__ import annotations

import torch

from fastprompt.ops import _cpp
from fastprompt.ops._cpp import signed_seed  # noqa: F401  (fastprompt.ops.attention_cpu.signed_seed, as before)


def available(q: torch.Tensor) -> bool:
    """Whether the kernel takes ``q``: a CPU tensor of a float type other than float64, extension built."""
    return q.device.type == "cpu" and q.dtype != torch.float64 and _built()


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


def _built() -> bool:
    return _cpp.available() and hasattr(torch.ops.fastprompt, "prefix_attention_cpu_fwd")


def _require() -> None:
    """Raise why the extension is missing."""
    if not _built():
        raise RuntimeError(_cpp.missing_reason())

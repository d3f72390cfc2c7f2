"""What both Triton kernel modules share (``contrastive_loss``, ``prefix_attention``): dtype names, interpreter
detection and the bf16 upcast rule, the launch-config type, named constants and the TF32 policy.

Interpreter detection: ``TRITON_INTERPRET=1`` at import time makes ``@triton.jit`` return interpreter objects
that run on CPU tensors (the tests). It is read once, when this module is imported, which happens before
either kernel module defines its kernels; each kernel module checks that its kernels agree.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastprompt.constants import COSINE_EPS  # noqa: F401  (the one norm floor of every backend; csrc checks it)

#: torch dtype -> Triton type name (the pointer types of ahead-of-time signatures); also the dtypes the
#: kernels take.
TRITON_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

#: log2(e): the kernels exponentiate with exp2, so natural-log quantities are scaled by it.
LOG2E = tl.constexpr(1.4426950408889634)
#: ln(2): turns a base-2 log-sum-exp back into a natural one.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _probe():
    pass


#: Whether the kernels of this process run in the Triton CPU interpreter.
INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def interpreting() -> bool:
    """Whether the kernels run in the Triton CPU interpreter (``TRITON_INTERPRET=1`` when they were imported)."""
    return INTERPRETED


def check_interpreted(*kernels) -> None:
    """Fail at import when ``TRITON_INTERPRET`` changed between this module and a kernel module (their kernels
    would then be built for the other mode than :func:`interpreting` says)."""
    for kernel in kernels:
        if (type(kernel).__name__ == "InterpretedFunction") != INTERPRETED:
            raise ImportError("TRITON_INTERPRET changed while fastprompt.kernels was being imported: set it once, "
                              "before the first import")


def upcast(dtype: torch.dtype) -> bool:
    """The kernels' ``UPCAST`` constexpr, one rule for both ops: convert every loaded tile to fp32 for bf16 under
    the interpreter, and never otherwise. The interpreter stores bf16 as raw 16-bit integers and computes on
    the bits (its ``tl.dot`` multiplies the integers), so bf16 results there are silently wrong. fp16 needs no
    upcast: the interpreter computes it as numpy float16 with float32 dot accumulation, as the GPU does, so the
    tests exercise the kernels' own fp16 path (the backward's scaled dS cast to the input dtype included).
    On a GPU the kernels read bf16 and fp16 natively, and fp32 needs no conversion."""
    return INTERPRETED and dtype == torch.bfloat16


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``, the one TF32 policy of both ops: fp32 inputs use TF32 tensor cores
    when torch allows them for CUDA matmuls (``torch.backends.cuda.matmul.allow_tf32``, which
    ``torch.set_float32_matmul_precision("high")`` sets), exact "ieee" products otherwise and always in the
    interpreter. fp16/bf16 operands are multiplied exactly whatever this says ("ieee" is recorded)."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 and not INTERPRETED:
        return "tf32"
    return "ieee"


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (``tl.constexpr`` arguments) and launch options of one kernel launch."""

    tiles: dict  # e.g. {"BLOCK_M": 64, "BLOCK_N": 64}
    num_warps: int = 4
    num_stages: int = 2
    # PTX .maxnreg. Without a bound ptxas may pick an occupancy-driven register count (e.g. 128 with 8 warps)
    # and spill a few words; with it, it allocates up to the bound. None leaves ptxas its heuristic.
    maxnreg: int | None = 255

    def options(self) -> dict:
        """The launch keyword arguments (``num_warps``, ``num_stages``, ``maxnreg``)."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages, maxnreg=self.maxnreg)

    def with_tiles(self, **tiles) -> "LaunchConfig":
        """This config with some tile sizes replaced (and others added)."""
        return dataclasses.replace(self, tiles={**self.tiles, **tiles})

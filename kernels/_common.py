"""What both Triton kernel modules share (``contrastive_loss``, ``prefix_attention``).

Interpreter detection: ``TRITON_INTERPRET=1`` at import time makes ``@triton.jit`` return interpreter objects
that run on CPU tensors (the tests). It is read once, when this module is imported, which happens before
either kernel module defines its kernels; each kernel module checks that its kernels agree.
"""
from __future__ import annotations

import triton


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

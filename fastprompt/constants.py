"""Numeric constants shared across layers (reference ops, Triton kernels, tests), in one torch-free module.

The Triton kernels (``fastprompt.kernels``) import from here rather than from ``fastprompt.ops``, so loading
a kernel module never loads the autograd ops that wrap it.
"""

#: Norm floor of the cosine similarity: a row z is normalised as z / max(||z||, COSINE_EPS), as
#: ``F.normalize`` does. The C++ kernel has its own copy, ``kCosEps`` in ``csrc/constants.h``, exposed as
#: ``torch.ops.fastprompt.cosine_eps()``; tests/ops/test_kernels_common.py checks that the two are equal.
COSINE_EPS = 1e-8

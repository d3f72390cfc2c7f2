"""Plain-PyTorch ground truth for every fused op in ``fastprompt.ops``.

These functions are deliberately simple (they materialise everything) and are used by the tests
and as the last-resort fallback backend. Autograd differentiates them.
"""
import torch  # noqa: F401

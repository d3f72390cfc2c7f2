"""Triton kernels (``@triton.jit`` functions and their launch helpers), installed as ``fastprompt.kernels``.

Nothing here knows about autograd or models: ``fastprompt.ops`` wraps these launches in
``torch.autograd.Function`` / ``torch.library`` ops and chooses the backend.
"""

"""Triton kernels (``@triton.jit`` functions and their launch helpers), installed as ``fastprompt.kernels``.

Nothing here knows about autograd or models: ``fastprompt.ops`` wraps these launches in
``torch.library`` ops and chooses the backend. Where these kernels may run (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``) is decided once, by :func:`fastprompt.backends.resolve_backend`, before a launch: the
launchers do not check it again.
"""

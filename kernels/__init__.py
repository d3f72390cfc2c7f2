"""Triton kernels (``@triton.jit`` functions and their launch helpers), installed as ``fastprompt.kernels``.

Nothing here knows about autograd or models: ``fastprompt.ops`` wraps these launches in
``torch.library`` ops and chooses the backend. Where these kernels may run (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``) is decided once, by :func:`fastprompt.backends.resolve_backend`, before a launch: the
launchers do not check it again.
"""

if __name__ == "kernels":
    # Imported as a top-level ``kernels``: Python runs from this checkout's root, where this folder (installed as
    # fastprompt.kernels) would shadow Hugging Face's ``kernels`` package, which transformers imports when it is
    # installed. Load the installed one in this module's place, or be an empty namespace if there is none.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _checkout])
    if _spec is None:
        # None installed: stand as an empty namespace portion (PEP 420: no file, no contents, no submodules), which
        # is what a folder without __init__.py would be; transformers reads that as "not installed"
        del __file__, importlib, os, sys
        __path__ = []
    else:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real  # what `import kernels` returns once this module's code has run
        _spec.loader.exec_module(_real)

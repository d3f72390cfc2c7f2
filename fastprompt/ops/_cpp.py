"""Loader of the optional C++ extension ``fastprompt._C`` (built from ``csrc/`` by setup.py or CMake), and what its
kernels share on the Python side (:func:`signed_seed`: how a dropout seed reaches their Philox generator).

Importing ``fastprompt._C`` registers the CPU kernels as ``torch.ops.fastprompt.*``. When the extension
was not built (no compiler, ``FASTPROMPT_NO_EXT=1``) the ops fall back to their PyTorch references
(:func:`fastprompt.backends.resolve_backend` logs the first fallback of each op, with :func:`missing_reason`).
"""
from __future__ import annotations

import importlib
import os

_state = {"tried": False, "module": None, "error": None}


def load_library(path: str) -> None:
    """Register the ops of a separately built library (e.g. the CMake build's ``libfastprompt_ops.so``)."""
    import torch

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no compiled fastprompt library at {path}")
    torch.ops.load_library(path)
    _state.update(tried=True, module=path, error=None)


def extension():
    """The imported ``fastprompt._C`` module (or the path of a library given to :func:`load_library`), else None."""
    if not _state["tried"]:
        _state["tried"] = True
        try:
            _state["module"] = importlib.import_module("fastprompt._C")
        except ImportError as exc:  # not built: the package still works through the references
            _state["error"] = exc
    return _state["module"]


def available() -> bool:
    return extension() is not None


def missing_reason() -> str | None:
    """Why the C++ kernels are not available (for the backend rule's messages), or None when they are."""
    if available():
        return None
    return (f"fastprompt._C (the C++ CPU kernels) is not built ({_state['error']}); build it with "
            "`pip install --no-build-isolation --no-deps -e .` (needs a C++ compiler)")


def signed_seed(seed: int) -> int:
    """A seed's 64 bits as a signed int64 (what a tensor or an op schema's int holds): the seed of the C++ kernels'
    Philox dropout (prefix attention's and the fused dropout + add + LayerNorm's)."""
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return seed - (1 << 64) if seed >= 1 << 63 else seed

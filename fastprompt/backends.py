"""Which implementation runs a fused op: one rule for every op, the capabilities each op declares, two errors.

Every fused op (``contrastive_loss``, ``prefix_attention``) has the backends of
:data:`fastprompt.choices.BACKENDS`: ``"triton"`` (its Triton kernels), ``"cpu"`` (its native non-Triton
path: the C++ kernel for the loss, an aten composite for attention), ``"reference"`` (plain PyTorch) and
``"auto"``. An op declares what its backends can take in an :class:`OpSupport`; :func:`resolve_backend`
applies the one rule (documented on it) to a concrete input. Standard library only: no torch import here
(the tensors passed in are only asked for ``device.type`` and ``dtype``, and the op's own checks).
"""
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from fastprompt.choices import BACKENDS, check_choice

logger = logging.getLogger(__name__)

#: Whether the triton package is installed (looked up once, without importing it).
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


class BackendUnavailableError(ValueError):
    """The requested backend cannot run here: a package is not installed, the C++ extension is not built,
    the tensor is on a device the backend does not run on, or the Triton interpreter is not in the state
    the device needs."""


class UnsupportedInputError(ValueError):
    """The backend runs here but not on this input (a dtype or a shape outside its kernels' limits)."""


#: Why an input cannot run (a short clause for an error message), or None when it can.
Limit = Callable[[Any], Optional[str]]


@dataclass(frozen=True)
class OpSupport:
    """What one op's backends can take; :func:`resolve_backend` holds the rule that chooses among them.

    Attributes:
        name: the op's name, in messages and the registry (``"contrastive_loss"``).
        triton_dtypes: the dtypes its Triton kernels take.
        triton_limits: further limits of the Triton kernels on an input (e.g. head dim <= 128): a function
            returning why the input is out of them, or None.
        native: what its ``"cpu"`` backend is, for messages ("the C++ kernel of fastprompt._C").
        native_devices: device types its ``"cpu"`` backend runs on; None: any device.
        native_missing: why its ``"cpu"`` backend is not available in this installation (e.g. the
            extension is not built), or None when it is; called, not stored, so a late build is seen.
        triton_variants: further backend names of this op that run on its Triton kernels, with the availability
            and input rules of ``"triton"`` (the loss's ``"chunked"``: cuBLAS products and a Triton epilogue).
    """

    name: str
    triton_dtypes: tuple
    native: str
    triton_limits: Optional[Limit] = None
    native_devices: Optional[tuple[str, ...]] = ("cpu",)
    native_missing: Optional[Callable[[], Optional[str]]] = None
    triton_variants: tuple[str, ...] = ()

    def triton_unavailable(self, tensor) -> Optional[str]:
        """Why the Triton kernels cannot run on ``tensor``'s device here, or None."""
        if not TRITON_INSTALLED:
            return "the triton package is not installed (pip install triton)"
        device = tensor.device.type
        if device not in ("cuda", "cpu"):
            return f"the Triton kernels run on CUDA (or on the CPU through the interpreter), not on {device}"
        interpreting = triton_interpreting()
        if device == "cpu" and not interpreting:
            return ("CPU tensors need the Triton interpreter: set TRITON_INTERPRET=1 before fastprompt.kernels "
                    "is imported")
        if device == "cuda" and interpreting:
            return "TRITON_INTERPRET=1 is set: the Triton kernels were built for the CPU interpreter"
        return None

    def triton_unsupported(self, tensor) -> Optional[str]:
        """Why the Triton kernels do not take ``tensor`` (dtype, shape), or None."""
        if tensor.dtype not in self.triton_dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in self.triton_dtypes)
            return f"its Triton kernels take {names}, got {str(tensor.dtype).replace('torch.', '')}"
        return self.triton_limits(tensor) if self.triton_limits is not None else None

    def native_unavailable(self, tensor) -> Optional[str]:
        """Why the ``"cpu"`` backend cannot run on ``tensor``'s device here, or None."""
        device = tensor.device.type
        if self.native_devices is not None and device not in self.native_devices:
            return f"{self.native} runs on {', '.join(self.native_devices)} tensors, not on {device}"
        return self.native_missing() if self.native_missing is not None else None


_REGISTRY: dict[str, OpSupport] = {}
_WARNED: set[str] = set()


def register_op(support: OpSupport) -> OpSupport:
    """Declare an op's capabilities under its name (each op module does this once, at import)."""
    _REGISTRY[support.name] = support
    return support


def op_support(name: str) -> OpSupport:
    """The registered :class:`OpSupport` of ``name``.

    The rule never imports an op: each op registers itself from its own module, which imports this one (the
    built-in ``contrastive_loss`` and ``prefix_attention`` register when ``fastprompt.ops`` is imported, as every
    call of them does)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown op {name!r}; registered: {', '.join(sorted(_REGISTRY))} (the built-in ops "
                         "register when fastprompt.ops is imported)")
    return _REGISTRY[name]


def triton_interpreting() -> bool:
    """Whether the Triton kernels run in the CPU interpreter (decided when ``fastprompt.kernels`` is imported).

    A downward import (the kernels are the layer below the rule), made on first use: the rule itself loads no
    torch and no triton."""
    from fastprompt.kernels._common import interpreting

    return interpreting()


def resolve_backend(op: str | OpSupport, tensor, requested: str) -> str:
    """The concrete backend (``"triton"``, ``"cpu"`` or ``"reference"``) that ``requested`` means for ``op`` on
    ``tensor`` (its main input: the embeddings of the loss, the queries of attention).

    The rule, the same for every op:

    - ``"reference"`` always runs.
    - ``"triton"`` (and each of the op's ``triton_variants``) needs the triton package and the tensor on CUDA
      with the interpreter off, or on the CPU with the interpreter on (else :class:`BackendUnavailableError`), and
      an input within the op's Triton dtypes and limits (else :class:`UnsupportedInputError`).
    - ``"cpu"`` needs the op's native path to run on the tensor's device and be available (the C++
      extension built) (else :class:`BackendUnavailableError`).
    - ``"auto"`` takes the first of: ``"triton"`` when the tensor is on CUDA and everything above holds
      (never the interpreter: it is for tests); ``"cpu"`` when everything above holds; ``"reference"``,
      with one warning per op and process that says why (it materialises what the fused paths stream).

    Both errors are ValueError subclasses; their messages name the op, the backend and the reason.
    """
    support = op if isinstance(op, OpSupport) else op_support(op)
    check_choice("backend", requested, BACKENDS + support.triton_variants)
    if requested == "reference":
        return requested
    if requested == "triton" or requested in support.triton_variants:
        reason = support.triton_unavailable(tensor)
        if reason is not None:
            raise BackendUnavailableError(f"{support.name}: backend={requested!r} is not available: {reason}")
        reason = support.triton_unsupported(tensor)
        if reason is not None:
            raise UnsupportedInputError(f"{support.name}: backend={requested!r} does not take this input: {reason} "
                                        "(use backend='cpu' or 'auto')")
        return requested
    if requested == "cpu":
        reason = support.native_unavailable(tensor)
        if reason is not None:
            raise BackendUnavailableError(f"{support.name}: backend='cpu' is not available: {reason}")
        return requested
    # auto
    reasons = []
    if tensor.device.type == "cuda":
        reason = support.triton_unavailable(tensor) or support.triton_unsupported(tensor)
        if reason is None:
            return "triton"
        reasons.append(f"Triton: {reason}")
    reason = support.native_unavailable(tensor)
    if reason is None:
        return "cpu"
    reasons.append(f"cpu: {reason}")
    if support.name not in _WARNED:
        _WARNED.add(support.name)
        logger.warning("%s falls back to the plain-PyTorch reference, which materialises what the fused backends "
                       "stream (slower, more memory): %s", support.name, "; ".join(reasons))
    return "reference"

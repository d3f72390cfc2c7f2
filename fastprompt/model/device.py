"""Devices and dtypes a user asks for: a clear error for a device this machine does not have, a warning for a
dtype that runs far slower than float32 where it was asked for."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_warned: set[tuple[torch.dtype, str]] = set()


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """The torch device for ``spec``: None or "auto" pick CUDA when available, else the CPU; anything else must
    name a device this machine has (ValueError otherwise, instead of an error deep inside torch)."""
    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {spec!r} is not a torch device (e.g. cpu, cuda, cuda:1): {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA GPU is visible (driver, CUDA_VISIBLE_DEVICES)")
            raise ValueError(f"device {spec!r} requested but {why} (torch {torch.__version__}); use device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {spec!r} requested but this machine has {count} CUDA device(s) "
                             f"(cuda:0 to cuda:{count - 1})")
    elif device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
            raise ValueError(f"device {spec!r} requested but torch reports no {device.type} device here")
    return device


def warn_if_slow(dtype: torch.dtype | None, device: str | torch.device) -> None:
    """Warn (once per process and combination) when ``dtype`` is known to be much slower than float32 on
    ``device``: float16 on the CPU, which has no fast half-precision matrix kernels on most processors."""
    device = torch.device(device)
    key = (dtype, device.type)
    if dtype != torch.float16 or device.type != "cpu" or key in _warned:
        return
    _warned.add(key)
    logger.warning("float16 on the CPU is many times slower than float32 (most CPUs have no fast float16 matrix "
                   "kernels; see docs/troubleshooting.md): use float32 on the CPU, float16 on a GPU")

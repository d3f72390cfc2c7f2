"""Devices and dtypes a user asks for: a clear error for a device this machine does not have, a warning for a
dtype that runs far slower than float32 where it was asked for.

The one device rule of fastprompt: :func:`resolve_device` (the encoder, ``fastprompt encode/eval``, the
trainer, torchrun's processes). Its syntax check, :func:`parse_device`, needs no torch, so the training
configuration rejects a malformed device before torch is imported. torch itself is imported on first use.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fastprompt.messages import shown

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

GiB = 1024 ** 3
_warned: set[tuple[torch.dtype, str]] = set()
_DEVICE = re.compile(r"([a-z_]+)(?::(\d+))?")


def parse_device(spec: str) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``, ``"cpu"`` -> ``("cpu", None)``, ``"auto"`` -> ``("auto", None)``.

    Syntax only (whether torch knows the type, and whether this machine has the device, is
    :func:`resolve_device`'s business); ValueError for anything that is not ``type`` or ``type:index``."""
    match = _DEVICE.fullmatch(spec) if isinstance(spec, str) else None
    if match is None:
        raise ValueError(f"device {shown(spec)} is not a torch device (e.g. cpu, cuda, cuda:1)")
    kind, index = match.groups()
    return kind, None if index is None else int(index)


def resolve_device(spec: str | torch.device | None = None) -> torch.device:
    """The torch device for ``spec``: None or "auto" pick CUDA when available, else the CPU; anything else must
    name a device this machine has (ValueError otherwise, instead of an error deep inside torch)."""
    import torch

    if spec is None or spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(spec, str):
        parse_device(spec)
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {shown(spec)} is not a torch device (e.g. cpu, cuda, cuda:1): {exc}") from None
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
    import torch

    device = torch.device(device)
    key = (dtype, device.type)
    if dtype != torch.float16 or device.type != "cpu" or key in _warned:
        return
    _warned.add(key)
    logger.warning("float16 on the CPU is many times slower than float32 (most CPUs have no fast float16 matrix "
                   "kernels; see docs/troubleshooting.md): use float32 on the CPU, float16 on a GPU")


def size_text(n: int) -> str:
    """Bytes for a message: ``1.5 GiB``, ``12.0 MiB``."""
    return f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / 1024 ** 2:.1f} MiB"


def available_bytes(device) -> int | None:
    """Memory a step can still use: free CUDA memory, else available RAM (psutil, else /proc/meminfo);
    None when unknown."""
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_allocation(nbytes: int, what: str, hint: str, device="cpu") -> None:
    """ValueError before allocating ``nbytes`` on ``device`` when they exceed the memory available there (an
    allocation of a size the user typed, ``prompt_length=1000000000``, fails with a bare RuntimeError or swaps
    the machine to a halt). ``what``: the thing allocated, ``hint``: what to do instead."""
    available = available_bytes(device)
    if available is not None and nbytes > available:
        raise ValueError(f"{what} needs {size_text(nbytes)}, more than the {size_text(available)} of memory "
                         f"available; {hint}")

"""Host reads of tensors: the switch that keeps value checks on the device, and the recorders that prove a training
step never waits on the GPU.

A CUDA training step must never read a device tensor on the host (``.item()``, ``bool(t)``, ``.tolist()``,
``nonzero``, ``torch.tensor(list, device=...)``, ...): each read waits for every kernel queued before it, and a
value read on the host is baked into the launches a CUDA graph captures. Value checks that would need a read
(offsets in range, finite inputs) are made with ``torch._assert_async`` instead wherever
:func:`checks_stay_on_device` says so: on CUDA tensors, under ``torch.compile``, and inside :func:`sync_free` — the
switch that lets the CPU suite run the CUDA path's host code on CPU tensors and prove it reads nothing
(``tests/train/test_host_path.py``, with :class:`HostReads` and :class:`TritonLaunches`).
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["sync_free", "checks_stay_on_device", "host_side", "HostReads", "HostRead", "TritonLaunches"]

_SYNC_FREE = contextvars.ContextVar("fastprompt_sync_free", default=False)
_HOST_SIDE = contextvars.ContextVar("fastprompt_host_side", default=False)


@contextlib.contextmanager
def sync_free():
    """Within this block fastprompt's code takes its device-side (asynchronous) checks on every device, as on CUDA:
    what the CPU tests use to run the CUDA path's host code."""
    token = _SYNC_FREE.set(True)
    try:
        yield
    finally:
        _SYNC_FREE.reset(token)


@contextlib.contextmanager
def host_side():
    """Marks code that reads tensors which live on the host in every run (a collator's fresh CPU tensors, a value
    copied to the host on purpose at a log row): :class:`HostReads` does not count what it reads."""
    token = _HOST_SIDE.set(True)
    try:
        yield
    finally:
        _HOST_SIDE.reset(token)


def checks_stay_on_device(*tensors: torch.Tensor | None) -> bool:
    """Whether a value check of ``tensors`` must not read them on the host: some are CUDA tensors, torch.compile
    is tracing, or :func:`sync_free` is on."""
    # is_compiling() first: Dynamo cannot trace a ContextVar's get (a graph break), and need not when compiling
    return (torch.compiler.is_compiling() or _SYNC_FREE.get()
            or any(t is not None and t.device.type != "cpu" for t in tensors))


# The functions that read a tensor's value on the host (a device-to-host copy and a stream sync on CUDA).
_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.__format__, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
    torch.Tensor.__array__, torch.equal, torch.Tensor.cpu, torch.masked_select, torch.Tensor.masked_select,
    torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.argwhere, torch.Tensor.argwhere,
}
# Functions whose result's size depends on the data unless told it (output_size): a sync on CUDA without it.
_SIZED_BY_DATA = {torch.repeat_interleave: "output_size", torch.Tensor.repeat_interleave: "output_size",
                  torch.bincount: None, torch.Tensor.bincount: None}
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class HostRead:
    """One host read: the function and the innermost frame of fastprompt's own code that called it."""

    function: str
    where: str  # "fastprompt/ops/attention.py:168 in prefix_attention"

    def __str__(self) -> str:
        return f"{self.function} at {self.where}"


class HostReads(TorchFunctionMode):
    """Records every host read of a tensor made from fastprompt's code while active (and turns :func:`sync_free`
    on, so the code takes the path it takes on CUDA). ``torch.tensor`` / ``torch.as_tensor`` of host data with an
    explicit device count too (a host-to-device copy that synchronises), as do data-sized results
    (``repeat_interleave`` without ``output_size``, ``bincount``). Reads made only by other libraries (transformers,
    torch itself) are not fastprompt's to fix and are left out; ``reads`` lists what was found, ``counts`` by
    place."""

    def __init__(self):
        super().__init__()
        self.reads: list[HostRead] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        self._stack.enter_context(sync_free())
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _HOST_SIDE.get() and self._is_read(func, args, kwargs):
            where = _own_frame()
            if where is not None:
                self.reads.append(HostRead(getattr(func, "__name__", str(func)), where))
        return func(*args, **kwargs)

    @staticmethod
    def _is_read(func, args, kwargs) -> bool:
        if func in _READS:
            return True
        if func in _SIZED_BY_DATA:
            keyword = _SIZED_BY_DATA[func]
            return keyword is None or kwargs.get(keyword) is None
        if func in (torch.tensor, torch.as_tensor) and "device" in kwargs:
            data = args[0] if args else kwargs.get("data")
            return not isinstance(data, torch.Tensor)
        return False

    @property
    def counts(self) -> Counter:
        return Counter(str(r) for r in self.reads)

    def report(self) -> str:
        return "\n".join(f"{n:4d} x {place}" for place, n in self.counts.most_common()) or "no host reads"


def _own_frame() -> str | None:
    """The innermost caller frame inside the fastprompt package (this module excluded), as "path:line in fn"."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE + os.sep) and path != os.path.abspath(__file__):
            return f"fastprompt/{os.path.relpath(path, _PACKAGE)}:{frame.lineno} in {frame.name}"
        if _kernels_path(path):
            return f"kernels/{os.path.basename(path)}:{frame.lineno} in {frame.name}"
    return None


def _kernels_path(path: str) -> bool:
    """fastprompt.kernels is installed from the top-level kernels/ folder (an editable install maps it there)."""
    parts = path.split(os.sep)
    return len(parts) >= 2 and parts[-2] == "kernels" and os.path.isfile(os.path.join(os.path.dirname(path), "aot.py"))


class TritonLaunches:
    """Counts the Triton kernel launches made while active (compiled kernels and the interpreter's alike: both
    launch through their class's ``run``): ``counts`` by kernel name, ``by_module`` by (module, kernel name).
    Re-entrant: an instance may be entered again later and keeps counting."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.by_module: Counter = Counter()
        self._patched: list[tuple[type, object]] = []

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for cls in (JITFunction, InterpretedFunction):
            original = cls.run

            def run(fn_self, *args, _original=original, **kwargs):
                inner = getattr(fn_self, "fn", fn_self)
                name = getattr(inner, "__name__", type(fn_self).__name__)
                self.counts[name] += 1
                self.by_module[getattr(inner, "__module__", "?"), name] += 1
                return _original(fn_self, *args, **kwargs)

            self._patched.append((cls, original))
            cls.run = run
        return self

    def __exit__(self, *exc):
        for cls, original in reversed(self._patched):
            cls.run = original
        self._patched.clear()
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())


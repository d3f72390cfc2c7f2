"""Kernel launch configurations tuned per GPU, shipped as data, and ``auto``'s measured choice of backend.

The way vLLM ships its fused-MoE configs (one JSON per device name) and SGLang keys them by Triton version too: a
*tuned table* holds, for one GPU model and one Triton version,

- ``entries``: the launch parameters (tile constexprs, ``num_warps``, ``num_stages``, ``maxnreg``) measured fastest
  for one kernel of one op at one *shape class* (a small dict of sizes and flags: ``{"dtype": "bf16", "D": 64,
  "S": 128, "P": 16, "dropout": false}``), with the time that won;
- ``choices``: for one op at one shape class, which backend ``auto`` takes on that GPU, ``"triton"`` (the fused
  kernels) or ``"plain"`` (the plain-PyTorch path: SDPA on the concatenated prefix for attention, the chunked-matmul
  loss for the contrastive loss), with the times of both sides that decided it.

Files are named ``device_name=<NAME>,triton=<VERSION>.json`` (NAME: ``torch.cuda.get_device_name()`` with runs of
characters other than letters, digits, ``.`` and ``-`` as ``_``) and searched in

1. the user's folder: ``$FASTPROMPT_TUNING_DIR``, else ``$XDG_CACHE_HOME/fastprompt/tuning`` (default
   ``~/.cache/fastprompt/tuning``): what ``fastprompt tune`` writes;
2. the package's ``fastprompt/kernels/configs/``: the GPUs the project measured.

For a device the file of the running Triton version is taken; else the device's file of the newest other version
(logged once: another compiler's fastest tiles may not be this one's); else none, and the kernels use their
heuristic defaults (logged once per device). Within a table, a query matches the entries of its op and kernel whose
flag values (strings, booleans) equal its own and whose size keys are the same; among them the nearest in sizes wins
(the sum over sizes of ``|log2(query) - log2(entry)|``). A choice applies only within :data:`CHOICE_RADIUS` of its
shape class (a measured choice is not stretched to sizes far from where it was measured). The format is documented
in ``docs/gpu.md`` ("Tuned kernel configurations").
"""
from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

#: The version of the file format this code reads and writes.
FORMAT = 1
#: The package's folder of tuned tables (GPUs the project measured).
PACKAGE_DIR = Path(__file__).resolve().parent / "configs"
#: Largest tuned-table file read (a table of every shape class of both ops is tens of kilobytes).
MAX_FILE_BYTES = 4 << 20
#: How far (log2 units summed over the sizes) a measured choice reaches from its shape class.
CHOICE_RADIUS = 2.0
#: The launch options an entry's config may set besides the tile constexprs (upper-case names).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")
BACKEND_CHOICES = ("triton", "plain")


def device_file_key(device_name: str) -> str:
    """``NVIDIA H200`` -> ``NVIDIA_H200``: the device part of a tuned table's file name."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name.strip()).strip("_") or "unknown"


def file_name(device_name: str, triton_version: str) -> str:
    return f"device_name={device_file_key(device_name)},triton={triton_version}.json"


def user_dir() -> Path:
    """The user's folder of tuned tables (searched before the package's; ``fastprompt tune`` writes there)."""
    env = os.environ.get("FASTPROMPT_TUNING_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastprompt" / "tuning"


def _is_flag(value) -> bool:
    return isinstance(value, (str, bool))


def _is_size(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _check_key(key, where: str) -> dict:
    if not isinstance(key, dict) or not key:
        raise ValueError(f"{where}: key must be a non-empty object of sizes and flags, got {key!r}")
    for name, value in key.items():
        if not isinstance(name, str) or not (_is_flag(value) or _is_size(value)):
            raise ValueError(f"{where}: key {name!r} must map to a string, a boolean or a positive number, got "
                             f"{value!r}")
    return dict(key)


def distance(query: dict, key: dict) -> float | None:
    """How far ``key`` is from ``query``: None when they differ in a flag or in which keys they have, else the sum
    over the sizes of ``|log2(query) - log2(key)|``."""
    if query.keys() != key.keys():
        return None
    d = 0.0
    for name, q in query.items():
        k = key[name]
        if _is_flag(q) or _is_flag(k):
            if q != k:
                return None
        else:
            d += abs(math.log2(q) - math.log2(k))
    return d


@dataclass(frozen=True)
class TunedEntry:
    """The launch parameters measured fastest for ``kernel`` of ``op`` at shape class ``key``."""

    op: str
    kernel: str
    key: dict
    config: dict  # tile constexprs (upper case) and launch options (num_warps, num_stages, maxnreg)
    ms: float | None = None  # the winner's median time

    def tiles(self) -> dict:
        return {k: v for k, v in self.config.items() if k not in LAUNCH_OPTIONS}

    def options(self) -> dict:
        return {k: v for k, v in self.config.items() if k in LAUNCH_OPTIONS}


@dataclass(frozen=True)
class BackendChoice:
    """``auto``'s backend for ``op`` at shape class ``key`` on this GPU, and the times that decided it."""

    op: str
    key: dict
    backend: str  # "triton" or "plain"
    ms: dict = field(default_factory=dict)  # {"triton": ..., "plain": ...}
    source: str = ""


@dataclass
class TunedTable:
    """One GPU model's tuned table (see the module docstring); ``path`` None for one built in memory."""

    device: str
    triton: str
    entries: list[TunedEntry] = field(default_factory=list)
    choices: list[BackendChoice] = field(default_factory=list)
    source: str = ""
    path: Path | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TunedTable":
        """Read and check one file; ValueError (naming the file) for one that is too large, not JSON or off the
        format."""
        path = Path(path)
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ValueError(f"{path}: {size} bytes, more than a tuned table's {MAX_FILE_BYTES}; not a tuned table")
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a tuned table (not UTF-8 JSON: {exc})") from None
        try:
            return cls.from_dict(data, path)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, data, path: Path | None = None) -> "TunedTable":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a tuned table of format {FORMAT} (a JSON object with \"format\": {FORMAT})")
        for name in ("device", "triton"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise ValueError(f"{name!r} must be a non-empty string")
        entries, choices = [], []
        for i, e in enumerate(data.get("entries", [])):
            where = f"entries[{i}]"
            if not isinstance(e, dict) or not isinstance(e.get("op"), str) or not isinstance(e.get("kernel"), str):
                raise ValueError(f"{where}: needs \"op\" and \"kernel\" strings")
            config = e.get("config")
            if not isinstance(config, dict) or not config or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0
                    for k, v in config.items()):
                raise ValueError(f"{where}: config must map tile and launch names to positive integers, got {config!r}")
            ms = e.get("ms")
            if ms is not None and not _is_size(ms):
                raise ValueError(f"{where}: ms must be a positive number, got {ms!r}")
            entries.append(TunedEntry(e["op"], e["kernel"], _check_key(e.get("key"), where), dict(config), ms))
        for i, c in enumerate(data.get("choices", [])):
            where = f"choices[{i}]"
            if not isinstance(c, dict) or not isinstance(c.get("op"), str) or c.get("backend") not in BACKEND_CHOICES:
                raise ValueError(f"{where}: needs an \"op\" string and a \"backend\" in {BACKEND_CHOICES}")
            ms = c.get("ms", {})
            if not isinstance(ms, dict) or not all(k in BACKEND_CHOICES and _is_size(v) for k, v in ms.items()):
                raise ValueError(f"{where}: ms must map backends to positive times, got {ms!r}")
            choices.append(BackendChoice(c["op"], _check_key(c.get("key"), where), c["backend"], dict(ms),
                                         str(c.get("source", ""))))
        return cls(data["device"], data["triton"], entries, choices, str(data.get("source", "")), path)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "device": self.device, "triton": self.triton, "source": self.source,
                "entries": [asdict(e) for e in self.entries], "choices": [asdict(c) for c in self.choices]}

    def entry(self, op: str, kernel: str, key: dict) -> TunedEntry | None:
        """The entry of ``op``'s ``kernel`` nearest to shape class ``key`` (None: no comparable entry)."""
        return _nearest(((e, distance(key, e.key)) for e in self.entries if e.op == op and e.kernel == kernel))

    def choice(self, op: str, key: dict) -> BackendChoice | None:
        """The measured backend choice for ``op`` nearest to ``key`` within :data:`CHOICE_RADIUS`, or None."""
        found = [(c, distance(key, c.key)) for c in self.choices if c.op == op]
        return _nearest((c, d) for c, d in found if d is not None and d <= CHOICE_RADIUS)

    def add_entry(self, entry: TunedEntry) -> None:
        """Add (or replace the entry of the same op, kernel and shape class)."""
        self.entries = [e for e in self.entries
                        if (e.op, e.kernel, e.key) != (entry.op, entry.kernel, entry.key)] + [entry]

    def add_choice(self, choice: BackendChoice) -> None:
        self.choices = [c for c in self.choices if (c.op, c.key) != (choice.op, choice.key)] + [choice]


def _nearest(candidates):
    best, best_d = None, math.inf
    for item, d in candidates:
        if d is not None and d < best_d:
            best, best_d = item, d
    return best


def search_dirs() -> list[Path]:
    return [user_dir(), PACKAGE_DIR]


def find_table_file(device_name: str, triton_version: str) -> tuple[Path | None, bool]:
    """(the file for this device, whether it is of this Triton version): this version's file in the user's folder,
    then the package's; else the device's file of the newest other version (user's first); else (None, False)."""
    exact = file_name(device_name, triton_version)
    for folder in search_dirs():
        if (folder / exact).is_file():
            return folder / exact, True
    prefix = f"device_name={device_file_key(device_name)},triton="
    for folder in search_dirs():
        others = sorted((p for p in folder.glob(prefix + "*.json") if p.is_file()),
                        key=lambda p: _version_tuple(p.name[len(prefix):-len(".json")]), reverse=True)
        if others:
            return others[0], False
    return None, False


def _version_tuple(text: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in re.split(r"[.+-]", text))


def triton_version() -> str:
    import triton

    return triton.__version__


@functools.lru_cache(maxsize=None)
def table_for(device_name: str, triton_ver: str | None = None) -> TunedTable | None:
    """The tuned table for a GPU model (cached; see the module docstring for the search order). A file that cannot
    be read is skipped with a warning naming it (the kernels then use their heuristic defaults)."""
    triton_ver = triton_ver or triton_version()
    path, exact = find_table_file(device_name, triton_ver)
    if path is None:
        logger.info("no tuned kernel configurations for %s (Triton %s): heuristic defaults; `fastprompt tune` "
                    "measures this GPU's (docs/gpu.md)", device_name, triton_ver)
        return None
    try:
        table = TunedTable.load(path)
    except (OSError, ValueError) as exc:
        logger.warning("tuned kernel configurations not used: %s; heuristic defaults instead", exc)
        return None
    if not exact:
        logger.info("tuned kernel configurations for %s from %s (Triton %s, running %s): the fastest tiles of another "
                    "compiler may differ; `fastprompt tune` measures this one's", device_name, path, table.triton,
                    triton_ver)
    return table


def device_name(device) -> str | None:
    """The GPU model of a CUDA device (torch.device or index), None for any other device."""
    import torch

    device = torch.device(device) if not isinstance(device, torch.device) else device
    if device.type != "cuda":
        return None
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def tuned_entry(op: str, kernel: str, key: dict, device) -> TunedEntry | None:
    """The tuned launch parameters of ``op``'s ``kernel`` at ``key`` on ``device`` (None: not a GPU, no table, no
    comparable entry: use the heuristic default)."""
    name = device_name(device)
    table = table_for(name) if name is not None else None
    return table.entry(op, kernel, key) if table is not None else None


def measured_choice(op: str, key: dict, device) -> BackendChoice | None:
    """``auto``'s measured backend for ``op`` at ``key`` on ``device``, or None (no table, nothing measured near)."""
    name = device_name(device)
    table = table_for(name) if name is not None else None
    return table.choice(op, key) if table is not None else None

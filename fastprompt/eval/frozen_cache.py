"""The frozen model's STS scores, cached: they are the same on every run of the same weights, sentences and
protocol, and computing them took 3.6 of a first run's 12.6 minutes on two cores (issue 40).

An entry is keyed by a SHA-256 of everything that decides the numbers: the backbone's weights and the tokenizer
(hashed from the loaded encoder, not its path), how sentences become vectors (pooler, template, denoising, top-k,
the end-of-sequence token, the evaluation's precision and batch size), the scored pairs themselves, the
evaluation protocol's version (:data:`PROTOCOL_VERSION`, bumped whenever the protocol changes), the device type and
torch's version (rounding). Any change gives another key, so a changed input is recomputed, never served stale.

Entries are JSON files ``<key>.json`` in the user's folder (``$FASTPROMPT_CACHE_DIR/frozen-scores``, else
``$XDG_CACHE_HOME/fastprompt/frozen-scores``, default ``~/.cache/fastprompt/frozen-scores``), written atomically
after a computation, then the package's ``fastprompt/eval/frozen_scores/`` (the quickstart's model on the shared
STS data, so that even a first run skips it). A run says where each number came from in its log; the config key
``frozen_cache: false`` (``fastprompt train --no-cache``) recomputes and rewrites.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The version of the evaluation protocol (docs/evaluation.md): bump it when the protocol changes what it scores.
PROTOCOL_VERSION = 1
#: The package's shipped entries.
PACKAGE_DIR = Path(__file__).resolve().parent / "frozen_scores"
MAX_ENTRY_BYTES = 1 << 20


def user_dir() -> Path:
    root = os.environ.get("FASTPROMPT_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "frozen-scores"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "fastprompt" / "frozen-scores"


def weights_digest(encoder) -> str:
    """SHA-256 of a loaded encoder's backbone weights (names, dtypes, shapes, bytes, in order) and its tokenizer."""
    import torch

    h = hashlib.sha256()
    for name, tensor in encoder.backbone.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    backend = getattr(encoder.tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(encoder.tokenizer.get_vocab(),
                                                                      sort_keys=True)).encode())
    return h.hexdigest()


def data_digest(datasets) -> str:
    """SHA-256 of the scored pairs themselves (``{task: STSData}``): every task's sentences and gold scores, in
    order: what the scores are computed from, whatever files they were read from."""
    import numpy as np

    h = hashlib.sha256()
    for name in sorted(datasets):
        data = datasets[name]
        h.update(name.encode() + b"\0")
        for a, b in zip(data.sentences1, data.sentences2):
            h.update(a.encode("utf-8", "surrogatepass") + b"\x1f" + b.encode("utf-8", "surrogatepass") + b"\x1e")
        h.update(np.asarray(data.scores, dtype=np.float64).tobytes())
    return h.hexdigest()


def entry_key(weights: str, setting: dict[str, Any], data: str, device: str) -> str:
    import torch

    torch_version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    payload = {"protocol": PROTOCOL_VERSION, "weights": weights, "setting": setting, "data": data,
               "device": device, "torch": torch_version}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def load(key: str) -> tuple[dict[str, Any] | None, Path | None]:
    """(the entry, its file), the user's first, then the package's; (None, None) when neither holds one. An
    unreadable entry is skipped with a warning (it is recomputed)."""
    for folder in (user_dir(), PACKAGE_DIR):
        path = folder / f"{key}.json"
        if not path.is_file():
            continue
        try:
            if path.stat().st_size > MAX_ENTRY_BYTES:
                raise ValueError("too large")
            entry = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(entry, dict) or entry.get("key") != key:
                raise ValueError("not an entry of this key")
            return entry, path
        except (OSError, ValueError) as exc:
            logger.warning("frozen-score cache entry %s not used (%s); computing the scores", path, exc)
    return None, None


def store(key: str, entry: dict[str, Any]) -> Path | None:
    """Write ``entry`` to the user's folder atomically; a failure (read-only home, full disk) is a warning."""
    from fastprompt.io import write_json_atomic

    path = user_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**entry, "key": key}, "frozen-score cache")
    except (OSError, ValueError) as exc:
        logger.warning("frozen scores not cached (%s)", exc)
        return None
    return path

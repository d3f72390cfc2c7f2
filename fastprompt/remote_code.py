"""No code from a model folder runs unless the user asks: the one rule every Hugging Face load follows.

A model folder (or hub repository) may name its own Python classes in ``config.json`` or ``tokenizer_config.json``
(``auto_map``); transformers imports and runs them when ``trust_remote_code=True``, and when the argument is left
out it asks on the terminal ("Do you wish to run the custom code? [y/N]"), so a "y" on standard input runs it.
fastprompt therefore passes ``trust_remote_code`` explicitly to every ``from_pretrained`` / ``from_config``: False
unless the user gave ``--trust-remote-code`` (training: ``trust_remote_code: true``). A local folder that asks for
its code is refused before transformers reads it (loading it with transformers' own class instead could give other
results silently); a hub repository that needs its code makes transformers raise, reworded here.

Standard library only.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

#: The files whose ``auto_map`` names a folder's own classes.
CODE_MAP_FILES = ("config.json", "tokenizer_config.json")
HINT = ("fastprompt runs no code from a model folder unless asked: read that code, then pass --trust-remote-code "
        "(training config: trust_remote_code: true; Python: trust_remote_code=True)")


def custom_code(folder: str | os.PathLike) -> dict[str, str]:
    """``{file: its auto_map classes}`` of a local model folder (empty when it names no code of its own)."""
    found = {}
    for name in CODE_MAP_FILES:
        path = Path(folder) / name
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # absent or unreadable: the loader reports it
        if isinstance(data, dict) and data.get("auto_map"):
            auto_map = data["auto_map"]
            found[name] = (", ".join(f"{k}: {v}" for k, v in auto_map.items()) if isinstance(auto_map, dict)
                           else str(auto_map))[:300]
    return found


def check_remote_code(model: str | os.PathLike, trust_remote_code: bool) -> None:
    """ValueError when the local folder ``model`` names code of its own and ``trust_remote_code`` is False."""
    if trust_remote_code or not Path(model).is_dir():
        return
    found = custom_code(model)
    if found:
        where = "; ".join(f"{name} auto_map: {classes}" for name, classes in found.items())
        raise ValueError(f"{model} asks to run its own Python code ({where}); {HINT}")


@contextlib.contextmanager
def refusing_remote_code(model: str | os.PathLike, trust_remote_code: bool):
    """:func:`check_remote_code`, then transformers' refusal (with ``trust_remote_code=False``) of a model that
    cannot load without its code, as one line with the hint."""
    check_remote_code(model, trust_remote_code)
    try:
        yield
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ValueError(f"{os.fspath(model)} needs its own Python code to load; {HINT}") from None

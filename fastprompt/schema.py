"""Typed JSON files: each JSON file fastprompt reads has a schema, checked where the file is read.

A schema is a dataclass whose annotations give the type of each key of a JSON object; a field without a default
is a required key. :func:`check_json` (and :func:`fastprompt.io.read_json` with ``schema=``) walks the data and
reports the first key of the wrong type in one line naming the file, the key and the expected type::

    training state runs/x/last/training_state.json: key 'trainer.state.global_step' must be an integer, got 'abc'

instead of a ``TypeError`` or ``KeyError`` deep inside the code that uses the value. Annotations understood:
``bool``, ``int``, ``float`` (an integer is a number too), ``str``, ``None``, ``Any``, ``list[T]``,
``tuple[T1, T2, ...]`` (a list of that length), ``dict[str, T]``, unions (``int | None``) and another schema (a
nested object). Numeric bounds come as field
metadata, as in :mod:`fastprompt.fields`: ``field(default=..., metadata={"ge": 1})``.

Unknown keys are allowed by default (files other tools write, or that a later version may extend); a schema with
``EXTRA = "forbid"`` refuses them (files that fastprompt alone writes and reads back whole). The data is returned
as it was (dicts and lists), so the code reading it is unchanged. Standard library only.
"""
from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

from fastprompt.fields import check_bounds
from fastprompt.messages import shown

_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null",
          list: "a list", dict: "an object"}


@functools.lru_cache(maxsize=None)
def _hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def expected(tp) -> str:
    """An annotation in words: ``an integer``, ``a string or null``, ``a list of integers``..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(expected(a) for a in args)
    if origin is list:
        return f"a list of {_plural(args[0])}" if args and args[0] is not Any else "a list"
    if origin is tuple:
        return f"a list of {len(args)}: {', '.join(expected(a) for a in args)}"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "an object"
    return _NAMES.get(tp, "any value")


def _plural(tp) -> str:
    words = expected(tp)
    return {"an integer": "integers", "a number": "numbers", "a string": "strings", "an object": "objects",
            "true or false": "booleans"}.get(words, f"values that are {words}")


def _matches(value, tp) -> bool:
    """Whether ``value`` has the JSON type ``tp`` at its top level (elements are checked on the way down)."""
    origin = typing.get_origin(tp) or tp
    if tp is Any:
        return True
    if origin is bool:
        return isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is type(None):
        return value is None
    if dataclasses.is_dataclass(tp):
        return isinstance(value, dict)
    if origin is tuple:
        return isinstance(value, list) and len(value) == len(typing.get_args(tp))
    return isinstance(value, origin)


def _check(value, tp, where: str, key: str) -> None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        chosen = next((a for a in options if _matches(value, a)), None)
        if chosen is None:
            raise ValueError(f"{where}: {_name(key)} must be {expected(tp)}, got {_as_json(value)}")
        return _check(value, chosen, where, key)
    if not _matches(value, tp):
        raise ValueError(f"{where}: {_name(key)} must be {expected(tp)}, got {_as_json(value)}")
    if dataclasses.is_dataclass(tp):
        _check_object(value, tp, where, key)
    elif typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        for i, v in enumerate(value):
            _check(v, item, where, f"{key}[{i}]")
    elif typing.get_origin(tp) is tuple:
        for i, (v, item) in enumerate(zip(value, typing.get_args(tp))):
            _check(v, item, where, f"{key}[{i}]")
    elif typing.get_origin(tp) is dict:
        _, item = typing.get_args(tp)
        for k, v in value.items():
            _check(v, item, where, f"{key}.{k}" if key else str(k))


def _check_object(data: dict, schema: type, where: str, key: str) -> None:
    hints = _hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    if getattr(schema, "EXTRA", "allow") == "forbid":
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise ValueError(f"{where}: unknown key {shown(_join(key, unknown[0]))}; "
                             f"{'the object ' + repr(key) if key else 'it'} holds only {', '.join(fields)}")
    for name, f in fields.items():
        path = _join(key, name)
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: {_name(path)} is missing (expected {expected(hints[name])})")
            continue
        value = data[name]
        _check(value, hints[name], where, path)
        bounds = {k: f.metadata[k] for k in ("ge", "gt", "le", "lt") if f.metadata.get(k) is not None}
        if bounds and isinstance(value, (int, float)) and not isinstance(value, bool):
            check_bounds(f"{where}: {_name(path)}", value, **bounds)


def _as_json(value) -> str:
    """A value as the file spells it: null, true, false, or bounded ``repr`` (see :func:`fastprompt.messages.shown`)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return shown(value)


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _name(key: str) -> str:
    return f"key {shown(key)}" if key else "the file"


def check_json(data, schema: type, where: str, key: str = ""):
    """``data`` (parsed JSON) when it matches ``schema`` (a dataclass, or any annotation such as
    ``list[int]``); otherwise a ValueError naming ``where`` (the file), the key and the expected type. ``key``:
    where ``data`` sits in its file (``"trainer"``: the object under that key), for the messages."""
    if not key and dataclasses.is_dataclass(schema) and not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {_as_json(data)}")
    _check(data, schema, where, key)
    return data

"""Documented, self-validating configuration fields, shared by every config dataclass.

A config dataclass (``PromptConfig``, ``ObjectiveConfig``, the sections of ``TrainConfig``) declares each
field with :func:`option`: its default, a one-line help text, and optionally its closed set of choices
(from :mod:`fastprompt.choices`) and numeric bounds. :func:`validate_fields` then coerces values read from
YAML or ``--set`` to the annotated type and checks choices and bounds, and the config reference
(``docs/config.md``, ``fastprompt train --help-config``) is generated from the same metadata, so a key's
rule and its documentation live in one place. Standard library only: configs validate before torch loads.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from fastprompt.choices import check_choice
from fastprompt.messages import shown


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: tuple[str, ...] | None = None,
           ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
           key: str | None = None, identity: bool | None = None, why: str | None = None,
           default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its documentation and rules.

    help: one line, shown in the config reference. choices: the allowed values (a tuple, or a mapping whose keys
    are, read at each check: a registry). ge/gt/le/lt: numeric bounds (``>= ge``, ``> gt``, ``<= le``, ``< lt``;
    at most one lower and one upper bound; None values of optional fields are not checked). why: what goes wrong
    outside the bounds, appended to the error (``temperature must be >= 0.001, got 0.0001: below it ...``).
    key: the flat configuration key when it differs from the field name (``PromptConfig.init`` is ``prompt_init``).
    identity: whether the key is part of a training run's identity, so that a run may not resume a checkpoint
    written with another value (:func:`identity_keys`). True for what the trained parameters are, what the
    evaluated embedding is, and what loss the run minimises on which batches (the objective and its terms'
    definitions and weights, the data's tokens and batches, the seed); False for how it gets there (learning
    rate, schedule length, precision, implementations, memory strategy), evaluation and the run's plumbing:
    those may change between an interrupt and a resume, with a warning. Every field of a training-config
    section decides (a test checks), so a new key cannot silently fall on either side.
    """
    if not help or "\n" in help:
        raise ValueError("every config field needs a one-line help text")
    if (ge is not None and gt is not None) or (le is not None and lt is not None):
        raise ValueError("give at most one lower bound (ge or gt) and one upper bound (le or lt)")
    metadata = {"help": help, "choices": choices, "ge": ge, "gt": gt, "le": le, "lt": lt, "key": key,
                "identity": identity, "why": why}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flat_key(f: dataclasses.Field) -> str:
    """The configuration key of a field (its name unless :func:`option` gave another)."""
    return f.metadata.get("key") or f.name


def identity_keys(*classes: type) -> tuple[str, ...]:
    """The flat keys of the fields of ``classes`` declared ``option(..., identity=True)``, in field order."""
    return tuple(flat_key(f) for cls in classes for f in dataclasses.fields(cls) if f.metadata.get("identity"))


def validate_fields(obj) -> None:
    """Coerce every field of the dataclass ``obj`` to its annotation, then check its choices and bounds.

    Error messages name the field by its flat key (what users write), the bad value and what is allowed.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        name = flat_key(f)
        value = coerce(name, getattr(obj, f.name), hints[f.name])
        object.__setattr__(obj, f.name, value)
        if value is None:
            continue
        meta = f.metadata
        for item in value if isinstance(value, list) else [value]:  # a list's rules are its items'
            if meta.get("choices") is not None:
                check_choice(name, item, meta["choices"])
            try:
                check_bounds(name, item, ge=meta.get("ge"), gt=meta.get("gt"), le=meta.get("le"), lt=meta.get("lt"))
            except ValueError as exc:
                if not meta.get("why"):
                    raise
                raise ValueError(f"{exc}: {meta['why']}") from None


class Section:
    """Base of a config dataclass whose fields are :func:`option` s: validates itself on construction (coercing
    YAML strings to the annotated types) and on :meth:`validate`. A subclass with rules between its fields
    overrides :meth:`validate`, calling ``super().validate()`` first."""

    def __post_init__(self):
        self.validate()

    def validate(self):
        validate_fields(self)
        return self


def check_bounds(name: str, value, *, ge=None, gt=None, le=None, lt=None) -> None:
    """Raise ``ValueError`` naming ``name`` when ``value`` is outside the bounds. A closed lower bound with an
    upper bound, or an open lower bound with a closed upper bound, is reported as an interval
    (``in [0, 1)``, ``in (0, 1]``); other bounds one at a time (``> 0``, then ``< 1``)."""
    if ge is not None and (lt is not None or le is not None) or (gt is not None and le is not None):
        lower_ok = value >= ge if ge is not None else value > gt
        upper_ok = value < lt if lt is not None else value <= le
        if not (lower_ok and upper_ok):
            interval = (f"{'[' if ge is not None else '('}{_number(ge if ge is not None else gt)}, "
                        f"{_number(lt if lt is not None else le)}{')' if lt is not None else ']'}")
            raise ValueError(f"{name} must be in {interval}, got {shown(value)}")
        return
    for bound, ok, sign in ((ge, lambda b: value >= b, ">="), (lt, lambda b: value < b, "<"),
                            (le, lambda b: value <= b, "<="), (gt, lambda b: value > b, ">")):
        if bound is not None and not ok(bound):
            raise ValueError(f"{name} must be {sign} {_number(bound)}, got {shown(value)}")


def _number(bound) -> str:
    """A bound as written in messages and the reference: an integer in full (a seed's 4294967295), a float short."""
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def describe_rule(f: dataclasses.Field) -> str:
    """The allowed values of a field in words, for the config reference ('' when any value of its type)."""
    meta = f.metadata
    if meta.get("choices"):
        return " | ".join(meta["choices"])
    signs = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return ", ".join(f"{sign} {_number(meta[k])}" for k, sign in signs.items() if meta.get(k) is not None)


def type_name(tp) -> str:
    """``int``, ``float | None``, ... of an annotation, for the config reference."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if typing.get_origin(tp) is list:
        return f"list[{type_name(args[0])}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


#: The most items a list-valued config key holds (Matryoshka dimensions, training files).
MAX_LIST_ITEMS = 64


def coerce(name: str, value: Any, tp) -> Any:
    """Check/convert one value against its annotation (YAML reads 3e-2 as a string, so numbers may be str). A
    ``list[T]`` key takes a YAML list or a comma-separated string (``--set matryoshka_dims=384,128``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        tp = next(a for a in args if a is not type(None))
    if value is None:
        raise ValueError(f"{name} must not be null")
    if typing.get_origin(tp) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",")] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list, got {shown(value)}")
        if len(value) > MAX_LIST_ITEMS:
            raise ValueError(f"{name} has {len(value)} items; at most {MAX_LIST_ITEMS}")
        (item,) = typing.get_args(tp)
        return [coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ValueError(f"{name} must be true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {shown(value)}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{name} must be an integer, got {shown(value)}") from None
        if not f.is_integer():
            raise ValueError(f"{name} must be an integer, got {shown(value)}")
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {shown(value)}")
        try:
            f = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an integer beyond float's range
            raise ValueError(f"{name} must be a number, got {shown(value)}") from None
        if not math.isfinite(f):
            raise ValueError(f"{name} must be finite, got {shown(value)}")
        return f
    if tp is str:
        if isinstance(value, (dict, list, tuple, set)):
            raise ValueError(f"{name} must be a string, got {shown(value)}")
        return str(value)
    return value

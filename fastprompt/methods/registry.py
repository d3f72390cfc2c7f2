"""The methods' registry: each method of ``fastprompt/methods/<name>/`` (or of your own package) is one
:class:`MethodSpec`, registered with one :func:`register_method` call (PEFT's ``register_peft_method`` is the
model). Training reads everything method-specific from here: the config sections (so the flat keys, their
documentation and the run-identity keys, from the fields' ``identity`` flags), the sentence objectives (the
``objective`` key's choices and :func:`fastprompt.objectives.objective_from_config`), the token terms' builders,
the cross-section checks, the data side (collator, training forward) and the commands a method adds.

Standard library only: a config validates before torch loads. What needs torch is named ``"module:attr"`` and
imported when a run is built (:func:`load`). See ``docs/methods.md``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from fastprompt.objectives.config import OBJECTIVE_REGISTRY, register_objective

#: A callable, or where it lives: ``"module:attr"`` (imported on first use, so registering needs no torch).
Target = str | Callable


@dataclass(frozen=True)
class MethodSpec:
    """One training method and everything it contributes.

    name: an identifier, unique. doc: its documentation page (``docs/<page>.md``).
    section: ``(attribute, dataclass, title)``: its config section (a :class:`fastprompt.fields.Section` whose
    fields are ``option(..., identity=...)``), read as ``config.<attribute>`` and written as flat keys; None: the
    method has no keys of its own.
    objective: the sentence-level objective (a ``SentenceObjective`` dataclass or its ``"module:Class"``)
    selectable as ``objective: <name>``; default_hinge_weight: its hinge_weight when the config leaves it null;
    objective_check: ``(objective section) -> None``: its rules on the objective section's keys when it is the
    chosen objective (standard library only).
    terms: ``(config, encoder) -> list of TokenTerm``: the token-level terms the config turns on (empty when off).
    check: ``(config) -> None``: the rules between its keys and other sections', raising ValueError (standard
    library only: it runs when a config is built).
    collator: ``(config, encoder, columns, views, text_ids) -> Collator | None``, and
    embed: ``(config, encoder, views) -> callable | None``: the method's own batches and training forward when
    the config asks for them (None: the default ones).
    commands: ``{subcommand: add_parser}`` (a callable or its ``"module:attr"``): command-line tools the method
    brings (data preparation), each a function adding its subparser to the ``fastprompt`` parser's subparsers, kept
    in the method's folder (``commands.py``): the command line reaches them through this registration only. A
    command over a training config sets ``training_inputs=True`` in its parser's defaults and is run as
    ``func(args, inputs)`` (:class:`fastprompt.cli.options.TrainingInputs`: the config, its examples and encoder),
    so it imports nothing above the methods.
    """

    name: str
    doc: str
    section: tuple[str, type, str] | None = None
    objective: Target | None = None
    default_hinge_weight: float = 0.0
    objective_check: Callable | None = None
    terms: Target | None = None
    check: Callable | None = None
    collator: Target | None = None
    embed: Target | None = None
    commands: dict[str, Target] = field(default_factory=dict)


#: name -> spec, in registration order (the order of the config sections and of the ``objective`` choices).
METHODS: dict[str, MethodSpec] = {}


def register_method(spec: MethodSpec) -> MethodSpec:
    """Register ``spec`` (refused when its name, its section's attribute or its objective's name is taken)."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register_method takes a MethodSpec, got {type(spec).__name__}")
    if not isinstance(spec.name, str) or not spec.name.isidentifier():
        raise ValueError(f"a method's name must be an identifier, got {spec.name!r}")
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is already registered")
    if spec.section is not None:
        attr, cls, _ = spec.section
        taken = {s.section[0]: s.name for s in METHODS.values() if s.section is not None}
        if attr in taken:
            raise ValueError(f"method {spec.name!r}: config section {attr!r} is method {taken[attr]!r}'s")
        if not (isinstance(cls, type) and hasattr(cls, "__dataclass_fields__")):
            raise TypeError(f"method {spec.name!r}: its section must be a config dataclass, got {cls!r}")
    for what in ("terms", "collator", "embed"):
        _check_target(spec, what)
    if spec.objective is not None:
        register_objective(spec.name, spec.objective, default_hinge_weight=spec.default_hinge_weight,
                           check=spec.objective_check)
    elif spec.objective_check is not None:
        raise ValueError(f"method {spec.name!r}: objective_check without an objective")
    METHODS[spec.name] = spec
    return spec


def unregister_method(name: str) -> MethodSpec:
    """Remove a registration (and its objective): for tests and interactive sessions."""
    spec = METHODS.pop(name)
    if spec.objective is not None:
        OBJECTIVE_REGISTRY.pop(name, None)
    return spec


def _check_target(spec: MethodSpec, what: str) -> None:
    target = getattr(spec, what)
    if isinstance(target, str) and target.count(":") != 1:
        raise ValueError(f"method {spec.name!r}: {what} is a callable or 'module:attr', got {target!r}")
    if target is not None and not isinstance(target, str) and not callable(target):
        raise TypeError(f"method {spec.name!r}: {what} must be callable, got {target!r}")


def load(target: Target) -> Callable:
    """The callable ``target`` names (imported on first use)."""
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


def sections() -> list[tuple[str, type, str]]:
    """The registered methods' config sections, in registration order."""
    return [spec.section for spec in METHODS.values() if spec.section is not None]


def objective_sections(config) -> dict[str, object]:
    """The objectives' own sections of a training config, by objective name: the section of each method that
    registers both (its objective's settings; :func:`fastprompt.objectives.objective_from_config` reads them)."""
    return {spec.name: getattr(config, spec.section[0]) for spec in METHODS.values()
            if spec.objective is not None and spec.section is not None}


def commands() -> dict[str, Target]:
    """Every registered method's subcommands: ``{subcommand: add_parser}`` (for the command line)."""
    out: dict[str, Target] = {}
    for spec in METHODS.values():
        for name, target in spec.commands.items():
            if name in out:
                raise ValueError(f"subcommand {name!r} is brought by two methods")
            out[name] = target
    return out

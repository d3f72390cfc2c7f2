"""Sentence-level objectives by name, and how a training config's objective section builds one.

The names and where each class lives are registered once, in :data:`fastprompt.objectives.config.OBJECTIVE_REGISTRY`,
by each method's registration (:func:`fastprompt.methods.register_method`; ``import fastprompt`` registers the
built-in ones); this module imports a class when it is built.
"""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from fastprompt.objectives.base import SentenceObjective
from fastprompt.objectives.config import OBJECTIVE_REGISTRY, ObjectiveConfig

#: ObjectiveConfig fields whose objective-class argument has another name.
_ARGUMENT = {"loss_backend": "backend"}


def objective_class(name: str) -> type[SentenceObjective]:
    """The class registered as ``name`` (imported on first use)."""
    if name not in OBJECTIVE_REGISTRY:
        raise ValueError(f"unknown objective {name!r}; available: {sorted(OBJECTIVE_REGISTRY)}")
    target = OBJECTIVE_REGISTRY[name].target
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    if not (isinstance(target, type) and issubclass(target, SentenceObjective) and dataclasses.is_dataclass(target)):
        raise TypeError(f"objective {name!r} is registered as {target!r}, not a SentenceObjective dataclass")
    return target


class _Objectives(Mapping):
    """name -> class of every registered objective, read from the registry at each access."""

    def __getitem__(self, name: str) -> type[SentenceObjective]:
        if name not in OBJECTIVE_REGISTRY:
            raise KeyError(name)
        return objective_class(name)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(OBJECTIVE_REGISTRY))

    def __len__(self) -> int:
        return len(OBJECTIVE_REGISTRY)


#: name -> class of the registered objectives (every class is a dataclass).
OBJECTIVES: Mapping[str, type[SentenceObjective]] = _Objectives()


def _arguments(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def build_objective(name: str, **params) -> SentenceObjective:
    """Instantiate an objective by name with ``params``; a keyword the objective does not take is an error
    (it would otherwise set nothing)."""
    cls = objective_class(name)
    unknown = sorted(set(params) - _arguments(cls))
    if unknown:
        raise ValueError(f"objective {name} takes no {', '.join(unknown)}; its settings: "
                         f"{', '.join(sorted(_arguments(cls)))}")
    return cls(**params)


def objective_from_config(config: ObjectiveConfig, sections: Mapping[str, Any] | None = None) -> SentenceObjective:
    """The sentence-level objective a training config's objective section describes: every argument of the
    objective's class that the section has a key for (``backend`` is ``loss_backend``, ``hinge_weight`` the
    resolved one). A key set to other than its default that the objective does not read is refused.

    ``sections``: the objectives' own config sections, by objective name (a method that registers an objective and
    a section owns its settings there: SKICSE's ``ski``; :func:`fastprompt.methods.objective_sections` of a
    training config). The chosen objective's section is read like the shared one; another objective's settings
    there set to other than their defaults are refused the same way (a section's fields that its objective does
    not take are its method's other settings, a token term's, and left alone)."""
    cls = objective_class(config.name)
    accepted = _arguments(cls)
    params, unused = {}, []
    for f in dataclasses.fields(ObjectiveConfig):
        if f.name == "name":
            continue
        arg = _ARGUMENT.get(f.name, f.name)
        value = config.resolved_hinge_weight if f.name == "hinge_weight" else getattr(config, f.name)
        if arg in accepted:
            params[arg] = value
        elif (value != 0 if f.name == "hinge_weight" else value != f.default):
            unused.append(f"{f.metadata.get('key') or f.name}={value!r}")
    for name, section in (sections or {}).items():
        own = accepted if name == config.name else _arguments(objective_class(name))
        for f in dataclasses.fields(section):
            if f.name not in own:  # the method's other settings (a token term's), not its objective's
                continue
            value = getattr(section, f.name)
            if name == config.name:
                params[f.name] = value
            elif value != f.default:
                unused.append(f"{f.metadata.get('key') or f.name}={value!r}")
    if unused:
        raise ValueError(f"objective {config.name} does not use {', '.join(unused)}: leave these keys at their "
                         f"defaults, or choose an objective that reads them")
    return cls(**params)

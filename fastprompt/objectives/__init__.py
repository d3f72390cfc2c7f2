"""Training objectives: the contract (:mod:`.base`), the objective section and registry (:mod:`.config`) and the
builder (:mod:`.registry`). The objectives and terms themselves live with their methods (``fastprompt/methods/``).

A training method is a :class:`Method`: one sentence-level objective over pooled embeddings
(:class:`fastprompt.methods.simcse.objective.SimCSE`, ...) plus token-level terms (:class:`TokenTerm`) with their
own forwards and weight schedules.
See :mod:`fastprompt.objectives.base` and ``docs/objectives.md``.

Imported lazily: :class:`~fastprompt.objectives.config.ObjectiveConfig` (standard library only) loads without
torch, so a training config validates before any model code is imported.
"""
from typing import TYPE_CHECKING

from fastprompt._lazy import lazy_getattr

if TYPE_CHECKING:  # the definitions, for type checkers and IDEs; at run time a name loads on first use
    from .base import Method as Method
    from .base import ObjectiveOutput as ObjectiveOutput
    from .base import SentenceObjective as SentenceObjective
    from .base import TokenTerm as TokenTerm
    from .base import Views as Views
    from .base import WeightSchedule as WeightSchedule
    from .config import OBJECTIVE_REGISTRY as OBJECTIVE_REGISTRY
    from .config import ObjectiveConfig as ObjectiveConfig
    from .config import register_objective as register_objective
    from .registry import OBJECTIVES as OBJECTIVES
    from .registry import build_objective as build_objective
    from .registry import objective_class as objective_class
    from .registry import objective_from_config as objective_from_config

_LAZY = {
    "Method": ".base",
    "ObjectiveOutput": ".base",
    "SentenceObjective": ".base",
    "TokenTerm": ".base",
    "Views": ".base",
    "WeightSchedule": ".base",
    "ObjectiveConfig": ".config",
    "OBJECTIVE_REGISTRY": ".config",
    "register_objective": ".config",
    "OBJECTIVES": ".registry",
    "build_objective": ".registry",
    "objective_class": ".registry",
    "objective_from_config": ".registry",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

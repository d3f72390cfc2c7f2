"""Training objectives: the contract (:mod:`.base`), one module per method, each composing fastprompt.ops.

A training method is a :class:`Method`: one sentence-level objective over pooled embeddings (:class:`SimCSE`,
:class:`PromCSEEH`, :class:`SKICSE`) plus token-level terms (:class:`TokenTerm`) with their own forwards and weight
schedules.
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
    from .config import MLMConfig as MLMConfig
    from .config import ObjectiveConfig as ObjectiveConfig
    from .config import register_objective as register_objective
    from .mlm import MLMTerm as MLMTerm
    from .promcse_eh import PromCSEEH as PromCSEEH
    from .registry import OBJECTIVES as OBJECTIVES
    from .registry import build_objective as build_objective
    from .registry import objective_class as objective_class
    from .registry import objective_from_config as objective_from_config
    from .simcse import SimCSE as SimCSE
    from .simcse import split_views as split_views
    from .skicse import SKICSE as SKICSE

_LAZY = {
    "Method": ".base",
    "ObjectiveOutput": ".base",
    "SentenceObjective": ".base",
    "TokenTerm": ".base",
    "Views": ".base",
    "WeightSchedule": ".base",
    "ObjectiveConfig": ".config",
    "MLMConfig": ".config",
    "OBJECTIVE_REGISTRY": ".config",
    "register_objective": ".config",
    "MLMTerm": ".mlm",
    "PromCSEEH": ".promcse_eh",
    "SimCSE": ".simcse",
    "split_views": ".simcse",
    "SKICSE": ".skicse",
    "OBJECTIVES": ".registry",
    "build_objective": ".registry",
    "objective_class": ".registry",
    "objective_from_config": ".registry",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

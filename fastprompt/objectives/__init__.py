"""Training objectives: the contract (:mod:`.base`), one module per method, each composing fastprompt.ops.

A training method is a :class:`Method`: one sentence-level objective over pooled embeddings (:class:`SimCSE`,
:class:`PromCSEEH`, :class:`SKICSE`) plus token-level terms (:class:`TokenTerm`) with their own forwards and weight
schedules.
See :mod:`fastprompt.objectives.base` and ``docs/objectives.md``.

Imported lazily: :class:`~fastprompt.objectives.config.ObjectiveConfig` (standard library only) loads without
torch, so a training config validates before any model code is imported.
"""
from fastprompt._lazy import lazy_getattr

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

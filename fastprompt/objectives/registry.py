"""Sentence-level objectives by name, and how a training config's objective section builds one."""
from __future__ import annotations

import dataclasses

from fastprompt.choices import OBJECTIVE_NAMES
from fastprompt.objectives.base import SentenceObjective
from fastprompt.objectives.config import ObjectiveConfig
from fastprompt.objectives.promcse_eh import PromCSEEH
from fastprompt.objectives.simcse import SimCSE
from fastprompt.objectives.skicse import SKICSE

#: name -> class (the names are fastprompt.choices.OBJECTIVE_NAMES); every class is a dataclass.
OBJECTIVES: dict[str, type[SentenceObjective]] = {"simcse": SimCSE, "promcse_eh": PromCSEEH,
                                                 "skicse": SKICSE}
assert tuple(OBJECTIVES) == OBJECTIVE_NAMES


def build_objective(name: str, **params) -> SentenceObjective:
    """Instantiate an objective by name; ``params`` may hold extra keys (e.g. a whole config dict)."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; available: {sorted(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in fields})


def objective_from_config(config: ObjectiveConfig) -> SentenceObjective:
    """The sentence-level objective a training config's objective section describes."""
    return build_objective(config.name, temperature=config.temperature,
                           hard_negative_weight=config.hard_negative_weight, hinge_margin=config.hinge_margin,
                           hinge_weight=config.resolved_hinge_weight, backend=config.loss_backend,
                           ski_weight=config.ski_weight, ski1_weight=config.ski1_weight,
                           ski2_weight=config.ski2_weight, ski2_denominator=config.ski2_denominator,
                           hardness_mode=config.hardness_mode, hardness_strength=config.hardness_strength,
                           fn_margin=config.fn_margin, fn_margin_strategy=config.fn_margin_strategy,
                           matryoshka_dims=tuple(config.matryoshka_dims) if config.matryoshka_dims else None,
                           matryoshka_weights=(tuple(config.matryoshka_weights) if config.matryoshka_weights
                                               else None))

"""SKICSE's section of a training config, ``ski`` (standard library only: it validates before torch loads).

Its keys are the objective's own settings (flat keys ``ski_weight``, ``ski1_weight``, ``ski2_weight``,
``ski2_denominator``): :func:`fastprompt.objectives.objective_from_config` reads them into
:class:`~fastprompt.methods.skicse.objective.SKICSE` when ``objective: skicse`` is chosen, and refuses them set
away from their defaults with another objective. The shared ones (temperature, hard negatives, the loss backend)
stay in the objective section every run has (:class:`~fastprompt.objectives.config.ObjectiveConfig`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastprompt.choices import SKI2_DENOMINATORS
from fastprompt.fields import Section, option


def check_ski_weights(ski_weight: float, ski1_weight: float, ski2_weight: float) -> None:
    """The weights of the sentence loss, (1 - λ) and (1 - λ1 - λ2), must not be negative."""
    for key, value in (("ski_weight", ski_weight), ("ski1_weight", ski1_weight), ("ski2_weight", ski2_weight)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{key} must be in [0, 1], got {value}")
    if ski1_weight + ski2_weight > 1.0:
        raise ValueError(f"ski1_weight + ski2_weight must be <= 1 (the supervised loss gets 1 - their sum), got "
                         f"{ski1_weight} + {ski2_weight}")


@dataclass
class SKICSEConfig(Section):
    """SKICSE's weights of the SKI terms and the reading of its Eq. 6 (``objective: skicse``)."""

    ski_weight: float = option(0.15, "skicse, sent0,ski rows: weight λ of L_ski in (1 - λ) L_simcse + λ L_ski",
                               ge=0.0, le=1.0, identity=True)
    ski1_weight: float = option(0.1, "skicse, NLI rows with a ski column: weight λ1 of L_ski1 (SKICSE Eq. 5: "
                                "anchor the SKI, positive the entailment)", ge=0.0, le=1.0, identity=True)
    ski2_weight: float = option(0.3, "skicse, NLI rows with a ski column: weight λ2 of L_ski2 (SKICSE Eq. 6: "
                                "anchor the sentence, positive its SKI)", ge=0.0, le=1.0, identity=True)
    ski2_denominator: str = option("printed", "skicse, NLI rows: the columns of Eq. 6's denominator: printed (the "
                                   "entailments and contradictions, as the paper prints it) or ski (the SKIs, "
                                   "Eq. 2's form; docs/ski.md)", choices=SKI2_DENOMINATORS, identity=True)


def ski_default(field: str):
    """The default of a :class:`SKICSEConfig` field (the :class:`SKICSE` class defaults to the config's values)."""
    return next(f.default for f in dataclasses.fields(SKICSEConfig) if f.name == field)

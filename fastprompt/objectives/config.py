"""ObjectiveConfig: the training configuration's section for the sentence-level objective.

Standard library only, so ``fastprompt train`` rejects a bad objective setting before torch loads. The
objective classes (:mod:`fastprompt.objectives.simcse`, ...) are built from it by
:func:`fastprompt.objectives.objective_from_config`. A token-level term (see :mod:`fastprompt.objectives.base`)
adds its own section dataclass here, with flat keys prefixed by the term's name (``mlm_weight``, ...).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.choices import BACKENDS, OBJECTIVE_NAMES
from fastprompt.fields import option, validate_fields

#: hinge_weight when the config leaves it null: PromCSE's objective is L_CL + 10 L_EH, SimCSE's has none.
DEFAULT_HINGE_WEIGHT = {"simcse": 0.0, "promcse_eh": 10.0, "skicse": 0.0}


def check_hinge_weight(objective: str, hinge_weight: float) -> None:
    """The one rule on hinge_weight: promcse_eh is defined by its hinge term."""
    if objective == "promcse_eh" and hinge_weight <= 0:
        raise ValueError(f"promcse_eh needs hinge_weight > 0 (PromCSE uses 10), got {hinge_weight}; "
                         "use objective=simcse for InfoNCE alone")


def check_ski_weights(ski_weight: float, ski1_weight: float, ski2_weight: float) -> None:
    """The weights of the sentence loss, (1 - λ) and (1 - λ1 - λ2), must not be negative."""
    for key, value in (("ski_weight", ski_weight), ("ski1_weight", ski1_weight), ("ski2_weight", ski2_weight)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{key} must be in [0, 1], got {value}")
    if ski1_weight + ski2_weight > 1.0:
        raise ValueError(f"ski1_weight + ski2_weight must be <= 1 (the supervised loss gets 1 - their sum), got "
                         f"{ski1_weight} + {ski2_weight}")


@dataclass
class ObjectiveConfig:
    """The sentence-level contrastive objective and the settings of its fused loss."""

    name: str = option("simcse", "sentence-level objective: SimCSE's InfoNCE, PromCSE's InfoNCE + energy-based "
                       "hinge, or SKICSE's InfoNCE + SKI terms (needs a ski column)", choices=OBJECTIVE_NAMES,
                       key="objective")
    temperature: float = option(0.05, "temperature of the cosine-similarity softmax", gt=0.0)
    hard_negative_weight: float = option(0.0, "added to each anchor's own hard-negative logit (log of SimCSE's "
                                         "weight; 0 = weight 1)")
    hinge_margin: float = option(0.2, "margin m of the energy-based hinge max(0, m + cos(h, hardest negative) - "
                                 "cos(h, h+))", ge=0.0)
    hinge_weight: float | None = option(None, "weight of the hinge term; null: the objective's default "
                                        "(simcse 0, promcse_eh 10)", ge=0.0)
    loss_backend: str = option("auto", "implementation of the fused contrastive_loss op", choices=BACKENDS)
    ski_weight: float = option(0.15, "skicse, sent0,ski rows: weight λ of L_ski in (1 - λ) L_simcse + λ L_ski",
                               ge=0.0)
    ski1_weight: float = option(0.1, "skicse, NLI rows with a ski column: weight λ1 of L_ski1 (sentence vs its SKI)",
                                ge=0.0)
    ski2_weight: float = option(0.3, "skicse, NLI rows with a ski column: weight λ2 of L_ski2 (SKI vs the "
                                "entailment)", ge=0.0)

    def __post_init__(self):
        self.validate()

    def validate(self) -> "ObjectiveConfig":
        validate_fields(self)
        check_hinge_weight(self.name, self.resolved_hinge_weight)
        if self.name == "skicse":
            if self.resolved_hinge_weight:
                raise ValueError("skicse has no hinge term: leave hinge_weight unset (or 0)")
            check_ski_weights(self.ski_weight, self.ski1_weight, self.ski2_weight)
        return self

    @property
    def resolved_hinge_weight(self) -> float:
        """hinge_weight, or the objective's default when it is null."""
        return DEFAULT_HINGE_WEIGHT[self.name] if self.hinge_weight is None else self.hinge_weight

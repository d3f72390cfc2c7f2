"""SKICSE's rules (standard library only: they run when a config is built): on the objective section when it is
the chosen objective, and on its own section's weights."""
from __future__ import annotations

from fastprompt.methods.skicse.config import check_ski_weights
from fastprompt.objectives.config import ObjectiveConfig


def check_skicse_section(section: ObjectiveConfig) -> None:
    """No hinge term and none of the fused loss's options (hardness, false-negative margin, Matryoshka): SKICSE's
    terms are its own."""
    if section.resolved_hinge_weight:
        raise ValueError("skicse has no hinge term: leave hinge_weight unset (or 0)")
    options = [k for k in ("hardness_mode", "fn_margin", "matryoshka_dims") if getattr(section, k) is not None]
    if options:
        raise ValueError(f"objective=skicse does not take {', '.join(options)} (simcse and promcse_eh do)")


def check_skicse(config) -> None:
    """With ``objective: skicse``, its weights (1 - λ) and (1 - λ1 - λ2) must not be negative (another objective
    refuses the section's keys set at all: :func:`fastprompt.objectives.objective_from_config`)."""
    if config.loss.name == "skicse":
        ski = config.ski
        check_ski_weights(ski.ski_weight, ski.ski1_weight, ski.ski2_weight)

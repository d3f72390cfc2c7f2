"""SKICSE's rules on the objective section (standard library only: they run when a config is built)."""
from __future__ import annotations

from fastprompt.objectives.config import ObjectiveConfig, check_ski_weights


def check_skicse_section(section: ObjectiveConfig) -> None:
    """No hinge term and none of the fused loss's options (hardness, false-negative margin, Matryoshka): SKICSE's
    terms are its own; its weights (1 - λ) and (1 - λ1 - λ2) must not be negative."""
    if section.resolved_hinge_weight:
        raise ValueError("skicse has no hinge term: leave hinge_weight unset (or 0)")
    options = [k for k in ("hardness_mode", "fn_margin", "matryoshka_dims") if getattr(section, k) is not None]
    if options:
        raise ValueError(f"objective=skicse does not take {', '.join(options)} (simcse and promcse_eh do)")
    check_ski_weights(section.ski_weight, section.ski1_weight, section.ski2_weight)

"""PromCSE's rule on the objective section (standard library only: it runs when a config is built)."""
from __future__ import annotations

from fastprompt.objectives.config import ObjectiveConfig, check_hinge_weight


def check_promcse_section(section: ObjectiveConfig) -> None:
    """promcse_eh is defined by its hinge term: its resolved hinge_weight must be > 0."""
    check_hinge_weight(section.name, section.resolved_hinge_weight)

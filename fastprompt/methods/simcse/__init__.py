"""SimCSE's InfoNCE over in-batch negatives (``objective: simcse``, the default): the sentence-level objective
every paper here builds on. Its settings are the shared objective section's keys (temperature, hard negatives,
the loss options: :class:`~fastprompt.objectives.config.ObjectiveConfig`); the loss is
:class:`fastprompt.methods.simcse.objective.SimCSE`. Docs: ``docs/objectives.md``."""
from fastprompt.methods.registry import MethodSpec, register_method

register_method(MethodSpec("simcse", doc="docs/objectives.md", objective="fastprompt.methods.simcse.objective:SimCSE"))

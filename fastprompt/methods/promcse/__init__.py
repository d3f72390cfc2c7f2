"""PromCSE's energy-based hinge (``objective: promcse_eh``): InfoNCE + hinge_weight * max(0, m + cos(h, hardest
negative) - cos(h, h+)), with hinge_weight 10 unless set (PromCSE's L_CL + 10 L_EH). Keys: hinge_margin and
hinge_weight of the objective section (run identity), checked by :mod:`.checks`; the loss:
:class:`fastprompt.methods.promcse.objective.PromCSEEH`. Docs: ``docs/objectives.md``."""
from fastprompt.methods.promcse.checks import check_promcse_section
from fastprompt.methods.registry import MethodSpec, register_method

register_method(MethodSpec("promcse_eh", doc="docs/objectives.md", default_hinge_weight=10.0,
                           objective="fastprompt.methods.promcse.objective:PromCSEEH",
                           objective_check=check_promcse_section))

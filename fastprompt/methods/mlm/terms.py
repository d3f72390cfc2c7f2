"""The MLM term a training config turns on (``do_mlm``), built for the encoder it runs through."""
from __future__ import annotations

from fastprompt.methods.mlm.term import MLMTerm
from fastprompt.objectives.base import TokenTerm, WeightSchedule


def mlm_terms(cfg, encoder) -> list[TokenTerm]:
    """``[MLMTerm]`` with the ``mlm`` section's head, probability and weight schedule; ``[]`` when off."""
    m = cfg.mlm
    if not m.enabled:
        return []
    return [MLMTerm.for_encoder(encoder, m.head, m.train_head, probability=m.probability,
                                weight=WeightSchedule(m.weight, m.decay_rate, m.decay_steps))]

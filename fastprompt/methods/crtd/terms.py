"""The CRTD term a training config turns on (``rtd_weight > 0``), built for the encoder it runs through."""
from __future__ import annotations

from fastprompt.methods.crtd.term import build_crtd_term
from fastprompt.objectives.base import TokenTerm


def crtd_terms(cfg, encoder) -> list[TokenTerm]:
    """``[CRTDTerm]`` as the ``rtd`` section describes it; ``[]`` when off."""
    return [build_crtd_term(cfg.rtd, encoder)] if cfg.rtd.enabled else []

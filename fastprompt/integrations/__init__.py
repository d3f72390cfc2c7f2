"""Meet users where they already work: each integration imports its optional library only when used.

- :func:`accelerate_peft` / :func:`restore_peft` — a PEFT prefix-tuning model runs fastprompt's fused prefix
  attention (``fastprompt.integrations.peft_attention``; needs ``peft``)
- ``MultipleNegativesRankingLoss``, ``CachedMultipleNegativesRankingLoss`` and the symmetric variants —
  sentence-transformers losses computed by fastprompt's fused contrastive loss
  (``fastprompt.integrations.st_loss``; needs ``sentence-transformers``)
"""
import importlib

_LAZY = {
    "accelerate_peft": "fastprompt.integrations.peft_attention",
    "restore_peft": "fastprompt.integrations.peft_attention",
    "MultipleNegativesRankingLoss": "fastprompt.integrations.st_loss",
    "MultipleNegativesSymmetricRankingLoss": "fastprompt.integrations.st_loss",
    "CachedMultipleNegativesRankingLoss": "fastprompt.integrations.st_loss",
    "CachedMultipleNegativesSymmetricRankingLoss": "fastprompt.integrations.st_loss",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fastprompt.integrations' has no attribute {name!r}")

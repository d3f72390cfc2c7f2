"""fastprompt: deep-prompt (prefix / P-tuning v2) contrastive sentence embeddings.

Public API (imported lazily so ``import fastprompt`` stays cheap):

- :class:`PrefixPrompt`, :class:`PromptConfig` — the trainable per-layer prefix key/values
- :class:`PromptEncoder` — a frozen Hugging Face encoder + prompts + pooling; ``encode()``, ``save()``, ``load()``
- :func:`contrastive_loss`, :func:`prefix_attention` — the fused ops (``fastprompt.ops``)
- :class:`Trainer`, :class:`TrainConfig` — the training loop (``fastprompt.train``)
- :func:`evaluate_sts` — the STS evaluation protocol (``fastprompt.eval``)
- :func:`accelerate_peft`, :func:`restore_peft` — fused prefix attention under a PEFT prefix-tuning model, and back
  (``fastprompt.integrations``)
"""
from fastprompt._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "PrefixPrompt": "fastprompt.model",
    "PromptConfig": "fastprompt.model",
    "PromptEncoder": "fastprompt.model",
    "contrastive_loss": "fastprompt.ops",
    "prefix_attention": "fastprompt.ops",
    "Trainer": "fastprompt.train",
    "TrainConfig": "fastprompt.train",
    "evaluate_sts": "fastprompt.eval",
    "accelerate_peft": "fastprompt.integrations",
    "restore_peft": "fastprompt.integrations",
}

__all__ = sorted(_LAZY) + ["__version__"]

__getattr__ = lazy_getattr(__name__, _LAZY)

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
from typing import TYPE_CHECKING

# Registers the built-in methods (their config sections, objectives and terms; standard library only), so a
# config or an objective can be built from any entry point.
from fastprompt import methods as _methods  # noqa: F401
from fastprompt._lazy import lazy_getattr
from fastprompt._version import __version__

if TYPE_CHECKING:  # the definitions, for type checkers and IDEs; at run time a name loads on first use
    from fastprompt.eval import evaluate_sts as evaluate_sts
    from fastprompt.integrations import accelerate_peft as accelerate_peft
    from fastprompt.integrations import restore_peft as restore_peft
    from fastprompt.model import PrefixPrompt as PrefixPrompt
    from fastprompt.model import PromptConfig as PromptConfig
    from fastprompt.model import PromptEncoder as PromptEncoder
    from fastprompt.ops import contrastive_loss as contrastive_loss
    from fastprompt.ops import prefix_attention as prefix_attention
    from fastprompt.train import TrainConfig as TrainConfig
    from fastprompt.train import Trainer as Trainer

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

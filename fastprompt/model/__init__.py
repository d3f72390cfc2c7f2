"""The prompted encoder: trainable prefixes (PrefixPrompt), soft input prompts, the frozen backbone wrapper
(PromptEncoder), pooling, PromptBERT templates and views.

Imported lazily, so that :class:`PromptConfig` (standard library only) loads without torch: a training config
validates before any model code is imported.
"""
from fastprompt._lazy import lazy_getattr

_LAZY = {
    "PromptConfig": ".config",
    "PrefixPrompt": ".prefix",
    "PromptEncoder": ".encoder",
    "DEFAULT_TEMPLATE": ".encoder",
    "Pooler": ".pooling",
    "POOLERS": ".pooling",
    "MLP_MODES": ".pooling",
    "resolve_model_path": ".resolve",
    "model_reference": ".resolve",
    "resolve_device": ".device",
    "PROMPTBERT_TEMPLATES": ".promptbert",
    "PromptBERTConfig": ".promptbert",
    "TemplateViews": ".promptbert",
    "tokenize_views": ".promptbert",
    "embed_views": ".promptbert",
}

__all__ = ["PromptConfig", "PrefixPrompt", "PromptEncoder", "Pooler", "POOLERS", "MLP_MODES",
           "DEFAULT_TEMPLATE", "resolve_model_path", "model_reference", "resolve_device", "PROMPTBERT_TEMPLATES",
           "PromptBERTConfig", "TemplateViews", "tokenize_views", "embed_views"]

__getattr__ = lazy_getattr(__name__, _LAZY)

"""The prompted encoder: trainable prefixes (PrefixPrompt), soft input prompts, the frozen backbone wrapper
(PromptEncoder), pooling, PromptBERT templates and views.

Imported lazily, so that :class:`PromptConfig` (standard library only) loads without torch: a training config
validates before any model code is imported.
"""
from typing import TYPE_CHECKING

from fastprompt._lazy import lazy_getattr

if TYPE_CHECKING:  # the definitions, for type checkers and IDEs; at run time a name loads on first use
    from .config import PromptConfig as PromptConfig
    from .device import resolve_device as resolve_device
    from .encoder import DEFAULT_TEMPLATE as DEFAULT_TEMPLATE
    from .encoder import PromptEncoder as PromptEncoder
    from .pooling import MLP_MODES as MLP_MODES
    from .pooling import POOLERS as POOLERS
    from .pooling import Pooler as Pooler
    from .prefix import PrefixPrompt as PrefixPrompt
    from .promptbert import PROMPTBERT_TEMPLATES as PROMPTBERT_TEMPLATES
    from .promptbert import PromptBERTConfig as PromptBERTConfig
    from .promptbert import TemplateViews as TemplateViews
    from .promptbert import embed_views as embed_views
    from .promptbert import tokenize_views as tokenize_views
    from .resolve import model_reference as model_reference
    from .resolve import resolve_model_path as resolve_model_path

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

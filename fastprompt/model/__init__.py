"""The prompted encoder: trainable prefixes (PrefixPrompt), soft input prompts, the frozen backbone wrapper
(PromptEncoder), pooling, PromptBERT templates and views."""
from .config import PromptConfig
from .encoder import DEFAULT_TEMPLATE, PromptEncoder
from .pooling import MLP_MODES, POOLERS, Pooler
from .prefix import PrefixPrompt
from .promptbert import PROMPTBERT_TEMPLATES, PromptBERTConfig, TemplateViews, embed_views, tokenize_views
from .resolve import resolve_model_path

__all__ = ["PromptConfig", "PrefixPrompt", "PromptEncoder", "Pooler", "POOLERS", "MLP_MODES",
           "DEFAULT_TEMPLATE", "resolve_model_path", "PROMPTBERT_TEMPLATES", "PromptBERTConfig", "TemplateViews",
           "tokenize_views", "embed_views"]

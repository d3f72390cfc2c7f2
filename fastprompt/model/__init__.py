"""The prompted encoder: trainable prefixes (PrefixPrompt), the frozen backbone wrapper (PromptEncoder), pooling."""
from .config import PromptConfig
from .encoder import DEFAULT_TEMPLATE, PromptEncoder
from .pooling import MLP_MODES, POOLERS, Pooler
from .prefix import PrefixPrompt
from .resolve import resolve_model_path

__all__ = ["PromptConfig", "PrefixPrompt", "PromptEncoder", "Pooler", "POOLERS", "MLP_MODES",
           "DEFAULT_TEMPLATE", "resolve_model_path"]

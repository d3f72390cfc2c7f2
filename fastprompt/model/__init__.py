"""The prompted encoder: trainable prefixes (PrefixPrompt), the frozen backbone wrapper (PromptEncoder), pooling."""
from .config import PromptConfig
from .device import resolve_device
from .encoder import DEFAULT_TEMPLATE, PromptEncoder
from .pooling import MLP_MODES, POOLERS, Pooler
from .prefix import PrefixPrompt
from .resolve import model_reference, resolve_model_path

__all__ = ["PromptConfig", "PrefixPrompt", "PromptEncoder", "Pooler", "POOLERS", "MLP_MODES",
           "DEFAULT_TEMPLATE", "model_reference", "resolve_model_path", "resolve_device"]

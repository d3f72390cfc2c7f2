"""The prompted encoder (PromptEncoder, ``encoder.py``) and what it composes: the frozen backbone and how a prompt
enters its architecture (``backbone.py``, ``attention.py``), the prompt kinds (PrefixPrompt in ``prefix.py``, soft
input tokens and the [CLS] prompt in ``soft_prompt.py``), the poolers (``pooling.py``), PromptBERT's templates,
denoising, OptiPrompt and views (``template.py``, ``promptbert.py``, ``mlm_head.py``) and checkpoints
(``checkpoint.py``).

Imported lazily, so that :class:`PromptConfig` (standard library only) loads without torch: a training config
validates before any model code is imported.
"""
from typing import TYPE_CHECKING

from fastprompt._lazy import lazy_getattr

if TYPE_CHECKING:  # the definitions, for type checkers and IDEs; at run time a name loads on first use
    from .config import PromptConfig as PromptConfig
    from .device import resolve_device as resolve_device
    from .encoder import PromptEncoder as PromptEncoder
    from .pooling import MLP_MODES as MLP_MODES
    from .pooling import POOLERS as POOLERS
    from .pooling import Pooler as Pooler
    from .prefix import PrefixPrompt as PrefixPrompt
    from .promptbert import PROMPTBERT_TEMPLATES as PROMPTBERT_TEMPLATES
    from .resolve import model_reference as model_reference
    from .resolve import resolve_model_path as resolve_model_path
    from .template import DEFAULT_TEMPLATE as DEFAULT_TEMPLATE

_LAZY = {
    "PromptConfig": ".config",
    "PrefixPrompt": ".prefix",
    "PromptEncoder": ".encoder",
    "DEFAULT_TEMPLATE": ".template",
    "Pooler": ".pooling",
    "POOLERS": ".pooling",
    "MLP_MODES": ".pooling",
    "resolve_model_path": ".resolve",
    "model_reference": ".resolve",
    "resolve_device": ".device",
    "PROMPTBERT_TEMPLATES": ".promptbert",
}

__all__ = ["PromptConfig", "PrefixPrompt", "PromptEncoder", "Pooler", "POOLERS", "MLP_MODES",
           "DEFAULT_TEMPLATE", "resolve_model_path", "model_reference", "resolve_device", "PROMPTBERT_TEMPLATES"]

__getattr__ = lazy_getattr(__name__, _LAZY)

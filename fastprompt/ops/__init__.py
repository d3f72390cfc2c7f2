"""Fused ops, one module per op: ``contrastive.py`` (:func:`contrastive_loss`) and ``attention.py``
(:func:`prefix_attention` for padded batches, :func:`prefix_attention_varlen` for packed ones, over one kernel
set), each a torch.library op with its device dispatch; ``reference.py`` holds the plain-PyTorch ground truth.
Which backend runs is one rule for both: :func:`fastprompt.backends.resolve_backend`.

The modules are named after what they hold, not after their functions, so that ``fastprompt.ops.contrastive_loss``
is always the function (``from fastprompt.ops import contrastive_loss, prefix_attention``).
"""
from .attention import draw_seed, prefix_attention, prefix_attention_varlen
from .contrastive import contrastive_loss
from .types import ContrastiveStats, Guide

__all__ = ["contrastive_loss", "ContrastiveStats", "Guide", "prefix_attention", "prefix_attention_varlen",
           "draw_seed"]

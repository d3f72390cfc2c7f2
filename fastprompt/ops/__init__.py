"""Fused ops, one module per op: ``contrastive.py`` (:func:`contrastive_loss`), ``attention.py``
(:func:`prefix_attention` for padded batches, :func:`prefix_attention_varlen` for packed ones, over one kernel
set) and ``add_norm.py`` (:func:`dropout_add_layer_norm`, BERT's closing dropout + residual add + LayerNorm), each
a torch.library op; ``reference.py`` holds the plain-PyTorch ground truth. Which backend runs the first two is one
rule: :func:`fastprompt.backends.resolve_backend`. The third has one kernel (C++, CPU, float32) and no backend to
choose: the model adapter applies it where it runs (``add_norm.applies``) and leaves the module's own forward
elsewhere (``add_norm.py`` says why).

The modules are named after what they hold, not after their functions, so that ``fastprompt.ops.contrastive_loss``
is always the function (``from fastprompt.ops import contrastive_loss, prefix_attention``).
"""
from .add_norm import dropout_add_layer_norm
from .attention import draw_seed, prefix_attention, prefix_attention_varlen
from .contrastive import contrastive_loss
from .types import ContrastiveStats, Guide

__all__ = ["contrastive_loss", "ContrastiveStats", "Guide", "prefix_attention", "prefix_attention_varlen",
           "dropout_add_layer_norm", "draw_seed"]

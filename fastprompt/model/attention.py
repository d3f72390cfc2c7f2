"""How the prefix reaches attention: a transformers attention function registered through the public
AttentionInterface, plus the DynamicCache path (what PEFT users run today) kept as the parity reference.

The prompted encoder passes a :class:`PrefixState` as the ``fastprompt_state`` keyword of the backbone's
forward; transformers threads extra keywords down to the attention function of every layer, which looks up
its own layer's prefix by ``module.layer_idx``. The prefix is never expanded over the batch.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "fastprompt"
_CACHE_KEYWORDS: dict[type, str] = {}


@dataclass
class PrefixState:
    """Per-forward inputs of the prefix attention function."""

    layers: list  # per layer: (prefix_k, prefix_v) of shape (H, P, D) or, one per example, (B, H, P, D); or None
    key_padding_mask: torch.Tensor  # (B, S) bool, True = real token
    backend: str = "auto"
    capture: dict | None = field(default=None)  # layer -> (k, v) of the first example; used by "vocab" init

    @property
    def prompt_index(self) -> torch.Tensor | None:
        """arange(B) when the prefixes are per example (prompt dropout in training), else None."""
        entry = next((e for e in self.layers if e is not None), None)
        if entry is None or entry[0].dim() == 3:
            return None
        return torch.arange(self.key_padding_mask.shape[0], device=self.key_padding_mask.device)


def prefix_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             fastprompt_state: PrefixState | None = None, **kwargs):
    """transformers attention function: (B, H, S, D) q/k/v -> ((B, S, H, D) output, None)."""
    state = fastprompt_state
    layer = getattr(module, "layer_idx", None)
    if state is not None and state.capture is not None:
        state.capture[layer] = (key[0].detach(), value[0].detach())
    entry = state.layers[layer] if state is not None and layer < len(state.layers) else None
    if entry is None:  # no prefix on this layer (or the backbone used on its own): stock SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    from fastprompt.ops import prefix_attention  # local import: ops must not be needed to build a model

    pk, pv = (t.to(query.dtype) for t in entry)
    out = prefix_attention(query, key, value, pk, pv, state.key_padding_mask, scale=scaling,
                           dropout_p=dropout, prompt_index=state.prompt_index, backend=state.backend)
    return out.transpose(1, 2), None


def register_attention() -> str:
    """Register the prefix attention function (and its mask builder) with transformers; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, prefix_attention_forward)
    # The function takes the (B, S) padding mask from PrefixState; transformers still builds a 4D mask for the
    # fallback path, which SDPA's builder does (it returns None when there is no padding).
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


def build_prefix_cache(layers: list, batch_size: int) -> DynamicCache:
    """The reference path: prefix keys/values expanded over the batch (unless already per example) into a
    fresh DynamicCache."""
    cache = DynamicCache()
    for i, entry in enumerate(layers):
        if entry is None:
            raise ValueError("the DynamicCache reference path needs a prefix on every layer "
                             "(input_layer_only prompts are only supported by the attention path)")
        k, v = (t if t.dim() == 4 else t.unsqueeze(0).expand(batch_size, -1, -1, -1) for t in entry)
        cache.update(k, v, i)
    return cache


def cache_keyword(backbone) -> str:
    """The keyword under which ``backbone``'s forward takes a key/value cache: ``cache`` where the forward
    declares it (transformers 5.24 renamed it, and removes the old ``past_key_values`` in 5.40; passing the old
    name meanwhile raises a FutureWarning), else ``past_key_values`` (older transformers). The signature is read
    once per model class (the deprecation decorators keep it through ``functools.wraps``)."""
    cls = type(backbone)
    if cls not in _CACHE_KEYWORDS:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):  # a forward without a readable signature: the long-standing name
            params = {}
        _CACHE_KEYWORDS[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KEYWORDS[cls]

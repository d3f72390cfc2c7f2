"""How the prefix reaches attention: a transformers attention function registered through the public
AttentionInterface, plus the DynamicCache path (what PEFT users run today) kept as the parity reference.

The prompted encoder passes a :class:`PrefixState` as the ``fastprompt_state`` keyword of the backbone's
forward; transformers threads extra keywords down to the attention function of every layer, which looks up
its own layer's prefix by ``module.layer_idx`` (or, for models whose attention modules carry none, such as
DistilBERT, by the map :func:`attention_layer_map` builds once). The prefix is never expanded over the batch.

Every call records the layer it served in ``PrefixState.served``; the encoder compares that with the layers that
hold a prefix after each forward (:func:`check_prefix_consumed`), so a model whose attention does not go
through the registered function (DeBERTa-v2 computes attention in its own modules) can never run with its prompt
silently ignored. MPNet, which does the same, gets the prefix through adapters of its attention modules
(:class:`OwnAttention`, :mod:`fastprompt.model.arch.mpnet`). Which family takes which path is its spec's
(:mod:`fastprompt.model.arch`).

Decoders (Llama, Mistral, Qwen2/3, Gemma): key/value heads may be fewer than query heads (grouped-query and
multi-query attention): the prefix then has one key/value per key/value head, shared by the query heads of
its group, as the model's own keys are. The token block is causal when the attention module says so
(``module.is_causal``) and limited to ``sliding_window`` tokens where the layer has one; the prefix stays
visible to every token (P-tuning v2 / PEFT semantics). The keys transformers hands over are already rotated
by RoPE; the prefix keys are used as they are: free vectors with no position, i.e. keys "already rotated",
exactly what PEFT's prefix cache holds.

Packed batches (:meth:`fastprompt.model.backbone.Architecture.forward_packed`): the real tokens of every sequence back
to back in one row, each with its own position ids; the state then carries the offsets (``cu_seqlens``) and every
layer's attention runs through the variable-length op (a layer without a prefix with an empty one), so no sequence
sees another's tokens and no (N, N) mask is ever built (:func:`packed_mask`). The offsets reach the layers one way
only: the ``fastprompt_state`` keyword (which gradient checkpointing replays with each layer's recomputation).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from fastprompt.host_sync import checks_stay_on_device

ATTN_IMPLEMENTATION = "fastprompt"
_CACHE_KEYWORDS: dict[type, str] = {}


@dataclass
class PrefixState:
    """Per-forward inputs of the prefix attention function."""

    layers: list  # per layer: (prefix_k, prefix_v) of shape (H, P, D) or, one per example, (B, H, P, D); or None
    key_padding_mask: torch.Tensor | None  # (B, S) bool, True = real token; None for a packed batch
    backend: str = "auto"
    capture: dict | None = field(default=None)  # layer -> (k, v) of the first example; used by "vocab" init
    layer_of: dict | None = None  # id(attention module) -> layer, for modules without a layer_idx
    served: set = field(default_factory=set)  # the layers the attention function ran for in this forward
    cu_seqlens: torch.Tensor | None = None  # packed batch: (B + 1,) offsets of the sequences in the one row
    max_seqlen: int | None = None  # packed batch: the padded width the sequences came from
    padded_index: torch.Tensor | None = None  # packed batch: (B, S) packed row of each padded slot, -1 at padding
    pooled_rows: torch.Tensor | None = None  # packed batch: (B,) the rows the last layer computes (pooled_rows.py)

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens.numel() - 1 if self.cu_seqlens is not None else self.key_padding_mask.shape[0]

    @property
    def prompt_index(self) -> torch.Tensor | None:
        """arange(B) when the prefixes are per example (prompt dropout in training), else None."""
        entry = next((e for e in self.layers if e is not None), None)
        if entry is None or entry[0].dim() == 3:
            return None
        return torch.arange(self.batch_size, device=entry[0].device)


def layer_index(module, state: PrefixState | None) -> int | None:
    """The backbone layer an attention module belongs to: its ``layer_idx``, else the encoder's map."""
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int):
        return layer
    return None if state is None or state.layer_of is None else state.layer_of.get(id(module))


def prefix_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             fastprompt_state: PrefixState | None = None, sliding_window: int | None = None,
                             softcap: float | None = None, **kwargs):
    """transformers attention function: (B, H, S, D) queries, (B, Hkv, S, D) keys/values -> ((B, S, H, D)
    output, None)."""
    state = fastprompt_state
    layer = layer_index(module, state)
    entry = None
    if state is not None:
        if layer is None:
            raise RuntimeError(f"fastprompt cannot tell which layer the attention module {type(module).__name__} "
                               "belongs to (it has no layer_idx and is not inside the backbone's layer list)")
        state.served.add(layer)
        if state.capture is not None:
            state.capture[layer] = (key[0].detach(), value[0].detach())
        entry = prefix_entry(state, layer, key)
    if entry is None:  # no prefix on this layer (or the backbone used on its own): stock SDPA
        if softcap is not None:
            kwargs["softcap"] = softcap
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    if softcap is not None:
        raise NotImplementedError(f"{type(module).__name__} caps its attention scores (attn_logit_softcapping = "
                                  f"{softcap}), which prefix attention does not compute; set "
                                  "attn_logit_softcapping to None in the model config to train a prefix on it")
    pk, pv = (t.to(query.dtype) for t in entry)
    causal = getattr(module, "is_causal", False) is True
    window = (-1, -1)
    if sliding_window is not None:  # as transformers' flash attention: (W - 1, W - 1), the causal mask cuts the right
        W = int(sliding_window)
        window = (W - 1, 0) if causal else (W - 1, W - 1)
    prompt_index = state.prompt_index if pk.dim() == 4 else None
    out = run_prefix_attention(state, query, key, value, pk, pv, scale=scaling, dropout_p=dropout,
                               prompt_index=prompt_index, causal=causal, window=window)
    return out.transpose(1, 2), None


def run_prefix_attention(state: PrefixState, q, k, v, prefix_k, prefix_v, **options) -> torch.Tensor:
    """The fused op for the layout of ``state``'s forward: ``prefix_attention`` over a padded batch (the state's
    padding mask), ``prefix_attention_varlen`` over a packed one (its offsets), on the state's backend."""
    from fastprompt.ops import prefix_attention, prefix_attention_varlen  # ops are not needed to build a model

    if state.cu_seqlens is not None:
        return prefix_attention_varlen(q, k, v, prefix_k, prefix_v, state.cu_seqlens, state.max_seqlen,
                                       backend=state.backend, **options)
    return prefix_attention(q, k, v, prefix_k, prefix_v, state.key_padding_mask, backend=state.backend, **options)


def prefix_entry(state: PrefixState, layer: int, key: torch.Tensor):
    """Layer ``layer``'s (prefix_k, prefix_v), None when it has none; in a packed batch an empty prefix instead of
    None (only the op's offsets keep the sequences apart). ``key``: the layer's (B, Hkv, S, D) keys."""
    entry = state.layers[layer] if layer < len(state.layers) else None
    if entry is None and state.cu_seqlens is not None:
        empty = key.new_empty(key.shape[1], 0, key.shape[-1])
        entry = (empty, empty)
    return entry


class OwnAttention:
    """The prefix for models whose attention modules compute attention themselves instead of calling
    transformers' attention functions, and whose forward does not pass extra keywords down (MPNet).

    The family's spec (:class:`fastprompt.model.arch.Family`, ``adapters``) replaces the ``forward`` of each such
    module instance (not the class: other models in the process are untouched) by an adapter that reads the
    current :class:`PrefixState` from :attr:`state`, which the encoder sets for the duration of each forward
    (MPNet supports no gradient checkpointing, so no recomputation in the backward runs outside it)."""

    def __init__(self):
        self.state: PrefixState | None = None


def layer_list(backbone, num_layers: int) -> torch.nn.ModuleList | None:
    """The backbone's list of ``num_layers`` layers (the first ``nn.ModuleList`` of that length, in module order),
    None when it has none."""
    return next((m for _, m in backbone.named_modules()
                 if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), None)


def attention_layer_map(layers: torch.nn.ModuleList | None) -> dict[int, int]:
    """id(module) -> layer index for every module inside the backbone's list of layers (:func:`layer_list`): how
    the attention function finds the layer of a module that carries no ``layer_idx`` (DistilBERT's). Empty when the
    backbone has no such list."""
    return {} if layers is None else {id(m): i for i, block in enumerate(layers) for m in block.modules()}


def packed_mask(device) -> torch.Tensor:
    """The ``attention_mask`` a packed batch hands the backbone: an empty, already prepared 4D mask, which
    transformers' mask builders (``create_bidirectional_mask``, ``create_causal_mask``, ...) return as it is instead
    of building the (N, N) mask of one row of N tokens, which could not keep the sequences apart anyway. The
    attention function ignores it: a packed :class:`PrefixState` (the ``fastprompt_state`` keyword, the one channel
    of the offsets) runs every layer through the variable-length op."""
    return torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=device)


def _mask(*args, **kwargs):
    """The registered mask builder: eager attention's additive float mask (a packed batch builds none:
    :func:`packed_mask`). On the CUDA path it never skips the mask of a batch without padding: finding that out
    reads the mask on the host (transformers' ``padding_mask.all()``), a wait for the GPU in every forward
    (docs/gpu.md, "The host path")."""
    mask = kwargs.get("attention_mask")
    if kwargs.get("allow_is_bidirectional_skip") and mask is not None and checks_stay_on_device(mask):
        kwargs["allow_is_bidirectional_skip"] = False
    return eager_mask(*args, **kwargs)


def check_prefix_consumed(prefixed, served, model_name: str) -> None:
    """RuntimeError when a layer in ``prefixed`` (the layers that hold a prefix) is not in ``served`` (those the
    prefix attention function ran for in the forward just run): its attention bypassed the function, so the prompt
    would change nothing."""
    missing = [i for i in prefixed if i not in served]
    if missing:
        raise RuntimeError(
            f"the prompt never reached the attention of {model_name}: layers {_ranges(missing)} hold a prefix, but "
            "their attention does not go through transformers' attention functions, where fastprompt adds it, so "
            "training would change nothing. Prefix (deep) prompts are not supported on this architecture; see "
            "docs/architectures.md for those that are (prompt_type='input' soft tokens do work here)")


def _ranges(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)) \
        else ", ".join(map(str, layers))


def register_attention() -> str:
    """Register the prefix attention function (and its mask builder) with transformers; idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, prefix_attention_forward)
    # The function takes the (B, S) padding mask from PrefixState; transformers still builds a 4D mask for the
    # layers without a prefix (stock SDPA, which takes an additive float mask too) and for models that compute
    # attention in their own modules: MPNet adds the mask to its scores, so it must be the additive float mask of
    # eager attention (0 / dtype min); SDPA's boolean one would add 1 and 0 and leave padding visible.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)
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


def check_cache_path(model, name: str, length: int) -> None:
    """The DynamicCache reference path needs a model that takes a cache, and differs from the attention path
    where a sliding window is shorter than prefix + tokens: the cache holds the prefix at positions 0..P-1, so
    the window hides it from distant tokens (PEFT's semantics), while the attention path keeps it visible.
    ``model``: the backbone, ``name`` how messages call it, ``length``: prefix + token positions."""
    if "past_key_values" not in inspect.signature(type(model).forward).parameters and \
            cache_keyword(model) != "cache":
        raise ValueError(f"prefix_mode='cache' passes the prefix as a key/value cache, which {name} "
                         "does not take; use prefix_mode='attention'")
    cfg = model.config
    window = getattr(cfg, "sliding_window", None)
    sliding = getattr(cfg, "use_sliding_window", True) and "sliding_attention" in (
        getattr(cfg, "layer_types", None) or ["sliding_attention"])
    if isinstance(window, int) and sliding and length > window:
        raise ValueError(f"prefix_mode='cache' would hide the prefix from tokens more than the sliding window "
                         f"({window}) past it (PEFT's semantics), here {length} prefix + token positions; "
                         "prefix_mode='attention' keeps it visible to every token")

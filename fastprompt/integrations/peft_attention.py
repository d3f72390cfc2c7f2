"""Fused prefix attention under an existing PEFT prefix-tuning model: :func:`accelerate_peft`.

PEFT runs prefix tuning by building, on every forward, a ``DynamicCache`` holding the prefix expanded over the
batch ((batch, heads, P, head_dim) per layer and per key/value; with ``prefix_projection`` the MLP even runs once
per example), which each attention layer then concatenates with its token keys/values. PEFT also refuses
gradient checkpointing for prefix tuning, because the cache is appended to again when a layer is recomputed.

:func:`accelerate_peft` keeps the PEFT model, its adapter and its ``save_pretrained``, and replaces only that
glue: the prefix is computed once per forward, viewed as (layers, 2, heads, P, head_dim) without a copy, and
handed to every layer through fastprompt's attention function (registered with transformers'
``AttentionInterface``, :mod:`fastprompt.model.attention`), which calls :func:`fastprompt.ops.prefix_attention`:
never expanded over the batch, never concatenated on the Triton path. It reproduces what PEFT computes
(checked against PEFT's own path, outputs and adapter gradients):

- PEFT's prefix layout: ``prompt_embeddings`` rows (P, layers * 2 * hidden) ordered (layer, key/value, head,
  head_dim), the key of layer l in slot 2l and its value in slot 2l + 1;
- the token positions PEFT gets from the model: the cache length P is added to them (positions P..P+S-1,
  fastprompt's ``position_mode: shifted``; explicit ``position_ids`` get P added, as PEFT does);
- ``token_type_ids`` are dropped with PEFT's warning, as PEFT does for prompt learning;
- the prefix always visible, padded tokens hidden.

Attention dropout in training draws fastprompt's seeded masks rather than SDPA's: the same distribution, not
the same draws. Supported: ``PeftModelForFeatureExtraction`` (``task_type="FEATURE_EXTRACTION"``) with an active
prefix-tuning adapter on an encoder whose attention goes through transformers' ``AttentionInterface`` and whose
positions are absolute embeddings (BERT, RoBERTa and their relatives). ``peft`` is an optional dependency.
"""
from __future__ import annotations

import logging
import types
import warnings

import torch

from fastprompt.choices import BACKENDS, check_choice
from fastprompt.model.attention import PrefixState, register_attention

logger = logging.getLogger(__name__)

__all__ = ["accelerate_peft", "restore_peft", "peft_prefix"]

_ORIGINAL_ATTN = "_fastprompt_original_attn_implementation"


def _peft():
    try:
        import peft
    except ImportError as exc:
        raise ImportError("accelerate_peft needs the peft package: pip install 'fastprompt[peft]'") from exc
    return peft


def accelerate_peft(model, *, backend: str = "auto"):
    """Make a PEFT prefix-tuning model run fastprompt's fused prefix attention; returns the same model.

    ``model`` is a ``peft.PeftModelForFeatureExtraction`` whose active adapter is prefix tuning (what
    ``get_peft_model(encoder, PrefixTuningConfig(task_type="FEATURE_EXTRACTION", ...))`` or
    ``PeftModel.from_pretrained`` returns for an encoder). Its outputs, adapter gradients, parameters and
    ``save_pretrained`` are unchanged; only the forward is routed through :func:`fastprompt.ops.prefix_attention`
    (``backend``: "auto", "triton", "cpu" or "reference", see there). Calling it again updates the backend;
    :func:`restore_peft` undoes it.
    """
    peft = _peft()
    if not isinstance(model, peft.PeftModelForFeatureExtraction):
        raise ValueError(f"accelerate_peft expects a peft PeftModelForFeatureExtraction (task_type='FEATURE_EXTRACTION'"
                         f"), got {type(model).__name__}")
    check_choice("backend", backend, BACKENDS)
    _check_prefix_config(model.active_peft_config, peft)
    base = model.get_base_model()
    _check_encoder(base, model.active_peft_config)
    if _ORIGINAL_ATTN not in model.__dict__:
        setattr(model, _ORIGINAL_ATTN, base.config._attn_implementation)
        base.set_attn_implementation(register_attention())
    model.forward = types.MethodType(_fused_forward, model)
    model._fastprompt_backend = backend
    return model


def restore_peft(model):
    """Undo :func:`accelerate_peft`: PEFT's own forward and the base model's previous attention; returns it."""
    if _ORIGINAL_ATTN not in model.__dict__:
        raise ValueError("restore_peft: this model was not accelerated by accelerate_peft")
    model.get_base_model().set_attn_implementation(model.__dict__.pop(_ORIGINAL_ATTN))
    del model.forward, model._fastprompt_backend
    return model


def _check_prefix_config(cfg, peft) -> None:
    if cfg.peft_type != peft.PeftType.PREFIX_TUNING:
        raise ValueError(f"accelerate_peft needs an active prefix-tuning adapter, got {cfg.peft_type}")
    if cfg.num_transformer_submodules != 1:
        raise ValueError("accelerate_peft supports encoder-only models (num_transformer_submodules=1), got "
                         f"{cfg.num_transformer_submodules}")


def _check_encoder(base, cfg) -> None:
    config = base.config
    name = type(base).__name__
    if getattr(config, "is_decoder", False) or getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"accelerate_peft supports encoder models only; {name} is a decoder or encoder-decoder")
    if not getattr(base, "_supports_attention_backend", False):
        raise ValueError(f"{name} does not route attention through transformers' AttentionInterface, which "
                         "accelerate_peft plugs into")
    if getattr(getattr(base, "embeddings", None), "position_embeddings", None) is None:
        raise ValueError(f"{name} has no absolute position embeddings: accelerate_peft supports BERT/RoBERTa-like "
                         "encoders, whose positions PEFT shifts by the prefix length")
    heads, hidden = config.num_attention_heads, config.hidden_size
    if (cfg.num_layers, cfg.num_attention_heads, cfg.token_dim) != (config.num_hidden_layers, heads, hidden):
        raise ValueError(f"the adapter is for {cfg.num_layers} layers x {cfg.num_attention_heads} heads, token_dim "
                         f"{cfg.token_dim}; {name} has {config.num_hidden_layers} x {heads}, hidden {hidden}")


def peft_prefix(model) -> torch.Tensor:
    """The active adapter's prefix as (layers, 2, heads, P, head_dim): a view of PEFT's (P, layers*2*hidden)
    rows, computed once (through the reparameterisation MLP when the adapter has one), never per example."""
    cfg = model.active_peft_config
    encoder = model.prompt_encoder[model.active_adapter]
    P = cfg.num_virtual_tokens
    if cfg.prefix_projection and not cfg.inference_mode:
        tokens = model.prompt_tokens[model.active_adapter][:P].to(encoder.embedding.weight.device)
        rows = encoder(tokens)  # the reparameterisation MLP, once: (P, layers * 2 * hidden)
    else:  # the stored rows themselves (PEFT looks up tokens 0..P-1 of this (P, ...) table, i.e. all of it)
        rows = encoder.embedding.weight
    if model.base_model_torch_dtype is not None:
        rows = rows.to(model.base_model_torch_dtype)
    H = cfg.num_attention_heads
    return rows.view(P, cfg.num_layers, 2, H, cfg.token_dim // H).permute(1, 2, 3, 0, 4)


def _shifted_positions(base, input_ids, inputs_embeds, shift: int):
    """The positions the model gives the tokens after a cache of length ``shift`` (what PEFT runs)."""
    emb = base.embeddings
    if hasattr(emb, "create_position_ids_from_input_ids"):  # RoBERTa family: numbered from padding_idx + 1
        if input_ids is None:
            return None  # RoBERTa numbers inputs_embeds from padding_idx + 1 whatever the cache length
        return emb.create_position_ids_from_input_ids(input_ids, emb.padding_idx, shift)
    ref = input_ids if input_ids is not None else inputs_embeds
    B, S = ref.shape[:2]
    return (torch.arange(S, device=ref.device) + shift).unsqueeze(0).expand(B, -1)


def _fused_forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, output_attentions=None,
                   output_hidden_states=None, return_dict=None, task_ids=None, **kwargs):
    """PeftModelForFeatureExtraction.forward for a prefix-tuning adapter, through fused prefix attention."""
    cfg = self.active_peft_config
    peft = _peft()
    if cfg.peft_type != peft.PeftType.PREFIX_TUNING:  # another adapter made active since: PEFT's own path
        return type(self).forward(self, input_ids, attention_mask, inputs_embeds, output_attentions,
                                  output_hidden_states, return_dict, task_ids, **kwargs)
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    base = self.get_base_model()
    P = cfg.num_virtual_tokens
    # what PEFT's prompt-learning forward does to the keyword arguments
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"] + P
    else:
        kwargs["position_ids"] = _shifted_positions(base, input_ids, inputs_embeds, P)
    if kwargs.get("token_type_ids") is not None:
        warnings.warn("Token type ids are not supported for parameter efficient tuning. Ignoring token type ids",
                      stacklevel=2)
        kwargs["token_type_ids"] = None
    prefix = peft_prefix(self)
    layers = [(prefix[i, 0], prefix[i, 1]) for i in range(prefix.shape[0])]
    mask = None if attention_mask is None else attention_mask.bool()
    state = PrefixState(layers, mask, self._fastprompt_backend)
    return base(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                return_dict=return_dict, fastprompt_state=state, **kwargs)

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
prefix-tuning adapter on a model whose attention goes through transformers' ``AttentionInterface``: encoders whose
positions are absolute embeddings (BERT, RoBERTa and their relatives) and the decoders Llama, Mistral (without a
sliding window), Qwen2, Qwen3 and Gemma. On a decoder PEFT's cache holds one prefix key/value per key/value head
(``num_attention_heads`` = ``num_key_value_heads`` in its config, grouped-query attention), the prefix keys are used
unrotated (RoPE rotates only the token keys), the tokens attend causally and see the whole prefix, and the tokens run
at positions P..P+S-1 whatever the padding side: all of which the fused path does too.

Refused before anything changes, each with the reason (:func:`_check_model`): models whose attention bypasses
``AttentionInterface`` (MPNet, DeBERTa-v2) or on which PEFT's prefix tuning itself fails (DistilBERT, ModernBERT:
there is no PEFT behaviour to reproduce), a sliding window (Mistral's ``sliding_window``, Gemma 2/3's sliding
layers: PEFT's cache puts the prefix at positions 0..P-1, so the window hides it from tokens more than a window
past it, while the fused op keeps it visible to every token, as P-tuning v2), score soft-capping (Gemma 2's
``attn_logit_softcapping``, which the fused op does not compute), and model types whose prefix PEFT reshapes
(``TRANSFORMERS_MODELS_TO_PREFIX_TUNING_POSTPROCESS_MAPPING``). ``peft`` is an optional dependency.
"""
from __future__ import annotations

import logging
import types
import warnings

import torch

from fastprompt.choices import BACKENDS, check_choice
from fastprompt.model.arch.positions import offset_position_ids, padding_offset
from fastprompt.model.attention import PrefixState, register_attention

from .peft_support import check_peft_runs

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
    ``PeftModel.from_pretrained`` returns for an encoder or a decoder; the module docstring says which). Its
    outputs, adapter gradients, parameters and ``save_pretrained`` are unchanged; only the forward is routed through
    :func:`fastprompt.ops.prefix_attention` (``backend``: "auto", "triton", "cpu" or "reference", see there).
    Calling it again updates the backend; :func:`restore_peft` undoes it. A model it would not reproduce PEFT on
    is refused (ValueError naming why) before anything changes.
    """
    peft = _peft()
    if not isinstance(model, peft.PeftModelForFeatureExtraction):
        raise ValueError(f"accelerate_peft expects a peft PeftModelForFeatureExtraction (task_type='FEATURE_EXTRACTION'"
                         f"), got {type(model).__name__}")
    check_choice("backend", backend, BACKENDS)
    _check_prefix_config(model.active_peft_config, peft)
    base = model.get_base_model()
    _check_model(base, model.active_peft_config)
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


def _is_causal(base) -> bool:
    return any(getattr(m, "is_causal", False) is True for m in base.modules())


def sliding_window(base) -> int | None:
    """The sliding window some attention layer of ``base`` applies, else None: the attention modules' own
    ``sliding_window`` (Qwen2, Gemma 2/3, ModernBERT: None on their global layers), else the config's (Mistral's
    layers read it from there)."""
    own = [m.sliding_window for m in base.modules() if hasattr(m, "sliding_window")]
    if own:
        return next((w for w in own if w is not None), None)
    return getattr(base.config, "sliding_window", None)


def _check_model(base, cfg) -> None:
    """ValueError, naming why, for a base model on which the fused path would not give PEFT's outputs."""
    config = base.config
    model_type = getattr(config, "model_type", None)
    name = f"{type(base).__name__} (model_type {model_type!r})"
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"accelerate_peft supports encoder-only and decoder-only models; {name} is an encoder-decoder")
    check_peft_runs(model_type, f"accelerate_peft has no PEFT behaviour to reproduce on {name}; train a fastprompt "
                    "prompt on it instead (PromptEncoder)")
    if not getattr(base, "_supports_attention_backend", False):
        raise ValueError(f"{name} does not route attention through transformers' AttentionInterface, which "
                         "accelerate_peft plugs into")
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_PREFIX_TUNING_POSTPROCESS_MAPPING as RESHAPED

    if RESHAPED.get(model_type) is not None:
        raise ValueError(f"PEFT reshapes the prefix of {name} for its own cache layout, which accelerate_peft does "
                         "not reproduce")
    causal = _is_causal(base)
    if getattr(config, "is_decoder", False) and not causal:
        raise ValueError(f"accelerate_peft does not support {name} configured as a decoder (is_decoder=True)")
    if not causal and getattr(getattr(base, "embeddings", None), "position_embeddings", None) is None:
        raise ValueError(f"{name} has no absolute position embeddings: accelerate_peft supports BERT/RoBERTa-like "
                         "encoders, whose positions PEFT shifts by the prefix length, and RoPE decoders")
    window = sliding_window(base)
    if window is not None:
        raise ValueError(f"{name} attends within a sliding window ({window} tokens), where PEFT's prefix tuning "
                         "and the fused path differ: PEFT's cache puts the prefix at positions 0..P-1, so the window "
                         "hides it from every token more than a window past it, while the fused op keeps it visible "
                         "to every token (P-tuning v2). accelerate_peft would not reproduce PEFT's outputs; train a "
                         "fastprompt prompt instead, or set sliding_window=None in the model config")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(f"{name} caps its attention scores (attn_logit_softcapping = {softcap}), which the fused "
                         "prefix attention does not compute")
    heads, hidden = config.num_attention_heads, config.hidden_size
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    expected = (config.num_hidden_layers, kv_heads, kv_heads * head_dim)
    if (cfg.num_layers, cfg.num_attention_heads, cfg.token_dim) != expected:
        raise ValueError(f"the adapter is for {cfg.num_layers} layers x {cfg.num_attention_heads} heads, token_dim "
                         f"{cfg.token_dim}; {name} has {expected[0]} layers x {kv_heads} key/value heads of "
                         f"{head_dim} (token_dim {expected[2]})")


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
    pad = padding_offset(base)
    if pad is not None:  # RoBERTa family: numbered from padding_idx + 1
        if input_ids is None:
            return None  # RoBERTa numbers inputs_embeds from padding_idx + 1 whatever the cache length
        return offset_position_ids(input_ids, pad, shift)
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
    if _is_causal(base):  # PEFT's cache is returned as past_key_values; the fused path needs no cache
        kwargs.setdefault("use_cache", False)
    return base(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                return_dict=return_dict, fastprompt_state=state, **kwargs)

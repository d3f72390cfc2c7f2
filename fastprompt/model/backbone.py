"""The frozen Hugging Face backbone: loaded strictly (:func:`load_backbone`: a folder that holds no model, weights
that do not fit the config, or a hub model that cannot be reached are clear errors, never silently random layers),
and :class:`Architecture`, how a prompt enters it.

:class:`Architecture` applies a backbone's rules for prompts: the prefix's shape (layers, key/value heads, head
size), whether the token block is causal, the position ids of tokens and soft input tokens
(:mod:`fastprompt.model.arch.positions`), and the forward that hands every layer its prefix, padded or packed,
through the attention functions of :mod:`fastprompt.model.attention` (or the DynamicCache reference path). What
differs between model families is their spec (:mod:`fastprompt.model.arch`, applied when the backbone is wrapped):
supporting another architecture means registering one (docs/architectures.md, "Adding an architecture").
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastprompt.io import read_json
from fastprompt.remote_code import refusing_remote_code

from .arch import apply, family_of, packable_model_types
from .arch.positions import check_position_offset, position_ids
from .attention import (
    PrefixState,
    attention_layer_map,
    build_prefix_cache,
    cache_keyword,
    check_cache_path,
    check_prefix_consumed,
    layer_list,
    packed_mask,
)
from .resolve import check_hub_model, resolve_model

CONFIG_FILE = "config.json"
#: The weights fastprompt loads: safetensors only (a pickle can run code when it is loaded).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
#: PyTorch pickles, named in the error for a folder that holds only those.
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.model")


@dataclass
class ModelConfigFile:
    """The keys of a Hugging Face ``config.json`` that fastprompt or transformers compute with, typed (the
    schema of :mod:`fastprompt.schema`; other keys are the model's business). A string where a count belongs
    (``num_attention_heads: "twelve"``) fails here in one line instead of inside transformers."""

    model_type: str | None = None
    architectures: list[str] | None = None
    num_hidden_layers: int = field(default=1, metadata={"ge": 1})
    num_attention_heads: int = field(default=1, metadata={"ge": 1})
    num_key_value_heads: int | None = field(default=None, metadata={"ge": 1})
    hidden_size: int = field(default=1, metadata={"ge": 1})
    head_dim: int | None = field(default=None, metadata={"ge": 1})
    intermediate_size: int = field(default=1, metadata={"ge": 1})
    max_position_embeddings: int = field(default=1, metadata={"ge": 1})
    vocab_size: int = field(default=1, metadata={"ge": 1})
    type_vocab_size: int = field(default=0, metadata={"ge": 0})
    pad_token_id: int | None = None
    layer_norm_eps: float = field(default=1e-12, metadata={"gt": 0})
    hidden_dropout_prob: float = field(default=0.0, metadata={"ge": 0, "le": 1})
    attention_probs_dropout_prob: float = field(default=0.0, metadata={"ge": 0, "le": 1})


def check_model_folder(path: str | os.PathLike, tokenizer: bool = True) -> None:
    """A local model folder must hold a config of the right types, safetensors weights and (unless ``tokenizer`` is
    false: a model that works on another model's token ids) a tokenizer; say which is missing or wrong
    (transformers would instead guess at a tokenizer class and ask for sentencepiece, or fail deep inside on a
    malformed config)."""
    path = Path(path)
    names = sorted(p.name for p in path.iterdir())
    holds = f"it holds {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}" if names else "it is empty"
    if CONFIG_FILE not in names:
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder: it has no {CONFIG_FILE} ({holds})")
    read_json(path / CONFIG_FILE, "model config", schema=ModelConfigFile)
    if not any(f in names for f in WEIGHT_FILES) and not any(n.endswith(".safetensors") for n in names):
        pickles = [f for f in PICKLE_FILES if f in names]
        if pickles:
            raise ValueError(f"{path} holds its weights only as a PyTorch pickle ({', '.join(pickles)}): fastprompt "
                             "loads only safetensors, because loading a pickle can run code; convert the folder "
                             "once where you trust it (AutoModel.from_pretrained(folder).save_pretrained(out))")
        raise FileNotFoundError(f"{path} has no model weights ({' or '.join(WEIGHT_FILES[:2])}; {holds})")
    if tokenizer and not any(f in names for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...; {holds})")


def _harmless_missing(key: str, model) -> bool:
    """A backbone weight absent from the checkpoint that changes nothing fastprompt computes: a buffer (constant
    position or token-type ids, rebuilt from the config) or the backbone's own pooler (Linear + Tanh over [CLS],
    whose output fastprompt never reads: its poolers work on the last hidden states)."""
    return key in dict(model.named_buffers()) or (key.startswith("pooler.") and hasattr(model, "pooler"))


def _harmless_unexpected(key: str, model) -> bool:
    """A checkpoint tensor the backbone has no place for is harmless when it belongs to another task's head
    (e.g. BERT's ``cls.predictions``) or is a buffer; one inside the backbone's own modules (``encoder.layer.7``
    when the config builds 6 layers) means the config describes another model."""
    children = {name for name, _ in model.named_children()}
    return key.split(".", 1)[0] not in children or key in dict(model.named_buffers())


def check_loading_info(info: dict, model, where: str) -> None:
    """Raise ValueError when the weights in ``where`` do not fit the model its config builds."""
    mismatched = sorted(info.get("mismatched_keys") or [])
    missing = sorted(k for k in info.get("missing_keys") or [] if not _harmless_missing(k, model))
    unexpected = sorted(k for k in info.get("unexpected_keys") or [] if not _harmless_unexpected(k, model))
    problems = []
    if mismatched:
        key, ckpt, built = mismatched[0]
        problems.append(f"{len(mismatched)} tensors have other shapes than the config gives (e.g. {key}: weights "
                        f"{tuple(ckpt)}, config {tuple(built)})")
    if missing:
        problems.append(f"{len(missing)} weights the config asks for are missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        problems.append(f"{len(unexpected)} weights have no place in the model the config builds "
                        f"(e.g. {', '.join(unexpected[:3])})")
    if info.get("error_msgs"):
        problems.append("; ".join(info["error_msgs"])[:500])
    if problems:
        raise ValueError(f"the config.json of {where} does not match its weights: {'; '.join(problems)}. "
                         "Fix the config (num_hidden_layers, hidden_size, ...) or use the model it was saved with")


@contextlib.contextmanager
def _quiet_transformers():
    """transformers prints its own load report (a table of MISSING/UNEXPECTED keys) before our error says the
    same in one line: silence it for the load."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_backbone(name_or_path: str | os.PathLike, *, attn_implementation: str, dtype=None,
                  trust_remote_code: bool = False):
    """(tokenizer, model) of a local folder, an installed model package or a hub id, loaded strictly. The model's
    own code runs only with ``trust_remote_code`` (:mod:`fastprompt.remote_code`)."""
    from safetensors import SafetensorError
    from transformers import AutoModel, AutoTokenizer

    where, kind = resolve_model(name_or_path)
    local_only = False
    if kind == "hub":
        local_only = check_hub_model(where)  # fails at once when the hub cannot be reached and nothing is cached
    else:
        check_model_folder(where)
    try:
        with _quiet_transformers(), refusing_remote_code(where, trust_remote_code):
            tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local_only,
                                                      trust_remote_code=trust_remote_code)
            model, info = AutoModel.from_pretrained(where, attn_implementation=attn_implementation, dtype=dtype,
                                                    local_files_only=local_only, output_loading_info=True,
                                                    ignore_mismatched_sizes=True, trust_remote_code=trust_remote_code,
                                                    use_safetensors=True)
    except SafetensorError as exc:
        raise ValueError(f"the model weights in {where} are corrupt or truncated: {exc}") from exc
    except OSError as exc:
        raise FileNotFoundError(f"could not load a Hugging Face model from {os.fspath(name_or_path)!r} "
                                f"(resolved to {where!r}): {exc}") from exc
    where = repr(os.fspath(name_or_path)) if kind == "hub" else where
    check_loading_info(info, model, where)
    check_position_offset(model, where)
    return tokenizer, model


class Architecture:
    """How a prompt enters one loaded backbone (see the module docstring); the encoder holds one per backbone."""

    def __init__(self, backbone):
        cfg = backbone.config
        if getattr(cfg, "is_encoder_decoder", False):  # T5, BART, ...: a forward needs decoder inputs too
            raise ValueError(f"{type(backbone).__name__} (model_type {getattr(cfg, 'model_type', '?')!r}) is an "
                             "encoder-decoder model, which fastprompt does not support: it trains prompts on encoders "
                             "(BERT, RoBERTa, MPNet, ...) and decoder-only models (see docs/architectures.md)")
        for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
            if not hasattr(cfg, attr):
                raise ValueError(f"backbone config has no {attr!r}: only encoder models with standard "
                                 "self-attention (BERT, RoBERTa, ...) are supported")
        self.model = backbone
        if getattr(cfg, "use_cache", False):
            # an encoder keeps no key/value cache (the "cache" prefix mode asks for one explicitly); with
            # the config's default True, transformers warns under gradient checkpointing
            cfg.use_cache = False
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // cfg.num_attention_heads
        #: heads of the prefix: the backbone's key/value heads (fewer than its query heads under grouped-query
        #: or multi-query attention, where each prefix key/value serves the query heads of its group)
        self.num_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        #: the token block is causal (a decoder): every token sees the tokens before it and the whole prefix
        self.causal = any(getattr(m, "is_causal", False) is True for m in backbone.modules())
        layers = layer_list(backbone, self.num_layers)
        self.layer_of = attention_layer_map(layers)
        #: the model family's spec (:mod:`fastprompt.model.arch`), applied to this backbone's modules
        self.family = family_of(getattr(cfg, "model_type", None))
        applied = apply(self.family, backbone, layers)
        self.own_attention = applied.own_attention  # MPNet: attention computed in its own modules
        #: output modules running dropout + residual add + LayerNorm as one fused op in training (:mod:`.add_norm`)
        self.fused_add_norm = applied.fused_add_norm
        #: the last layer can compute the pooled rows only (:mod:`fastprompt.model.pooled_rows`), in packed batches
        self.pooled_rows_only = applied.pooled_rows_only

    @property
    def name(self) -> str:
        return f"{type(self.model).__name__} (model_type {getattr(self.model.config, 'model_type', '?')!r})"

    def position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     positions: torch.Tensor | None = None, *, shift: int = 0, soft=None,
                     explicit: bool = False) -> torch.Tensor | None:
        """Explicit position ids where transformers' defaults would be wrong for us, else None
        (:func:`fastprompt.model.arch.positions.position_ids`)."""
        return position_ids(self.model, input_ids, attention_mask, positions, shift=shift, soft=soft,
                            explicit=explicit)

    def forward(self, attention_mask: torch.Tensor, layers: list, *, prefix_mode: str, backend: str,
                capture: dict | None = None, **inputs) -> torch.Tensor:
        """The backbone's last hidden states, each layer with its prefix (``layers``: per layer (k, v) or None):
        through the registered attention function (``prefix_mode="attention"``), which must serve every layer
        that holds one, or expanded into a DynamicCache (``"cache"``, the reference path)."""
        if prefix_mode == "attention":
            state = PrefixState(layers, attention_mask.bool(), backend, capture, self.layer_of)
            out = self._run_with(state, attention_mask=attention_mask, **inputs)
            check_prefix_consumed([i for i, e in enumerate(layers) if e is not None], state.served, self.name)
        elif all(e is None for e in layers):
            out = self.model(attention_mask=attention_mask, **inputs)
        else:
            B, P = attention_mask.shape[0], layers[0][0].shape[-2]
            check_cache_path(self.model, self.name, P + attention_mask.shape[1])
            cache = build_prefix_cache(layers, B)
            mask = torch.cat([attention_mask.new_ones(B, P), attention_mask], dim=1)
            inputs[cache_keyword(self.model)] = cache
            out = self.model(attention_mask=mask, use_cache=True, **inputs)
        return out.last_hidden_state

    def _run_with(self, state: PrefixState, **inputs):
        """The backbone's forward with ``state`` reaching its attention: as the ``fastprompt_state`` keyword
        transformers threads down (hooks on the backbone read it there too), and through the adapters' slot for
        attention computed in its own modules, whose forward drops the keyword (MPNet)."""
        if self.own_attention is None:
            return self.model(fastprompt_state=state, **inputs)
        self.own_attention.state = state
        try:
            return self.model(fastprompt_state=state, **inputs)
        finally:  # the backbone called on its own runs without the prefix
            self.own_attention.state = None

    def packing_refusal(self) -> str | None:
        """Why this backbone cannot run packed batches (:meth:`forward_packed`), or None when it can."""
        if not self.family.packs:
            return (f"{self.name} is not among the architectures whose packed forward is tested to equal the padded "
                    f"one ({', '.join(packable_model_types())})")
        return None

    def forward_packed(self, attention_mask: torch.Tensor, layers: list, *, backend: str, position_ids: torch.Tensor,
                       pooled: torch.Tensor | None = None, num_tokens: int | None = None, **inputs) -> torch.Tensor:
        """:meth:`forward` of the batch's real tokens only: the rows' tokens (where ``attention_mask`` is 1, whichever
        side the padding is on) back to back in one row of N tokens, each with the position id it has in the padded
        batch (``position_ids``, (B, S), required: the backbone's defaults would count positions along the packed
        row), through every layer; the attention function keeps the sequences apart with their offsets. Returns the
        (B, S, hidden) last hidden states of the padded layout, zero at the padding.

        ``pooled`` ((B,) positions in the padded rows, where :attr:`pooled_rows_only`): the last layer computes
        those rows only, and only they are filled in.

        ``num_tokens``: the number of real tokens N, known on the host (``Batch.lengths``): the layout is then
        built without reading the mask back (no device sync); without it N is read from the mask."""
        keep = attention_mask.bool()
        B, S = keep.shape
        lengths = keep.sum(1)
        cu_seqlens = torch.zeros(B + 1, dtype=torch.int64, device=keep.device)
        cu_seqlens[1:] = lengths.cumsum(0)
        flat = keep.flatten()
        if num_tokens is None:
            N = int(lengths.sum())  # host read: without the host lengths only (callers that pass none)
        else:
            N = int(num_tokens)
            torch._assert_async(lengths.sum() == N, "num_tokens differs from the attention mask's real tokens")
        order = flat.cumsum(0) - 1  # a real token's row in the packed layout
        # each real token's padded index, scattered to its packed row; the padding lands on a spare row N
        rows = torch.full((N + 1,), B * S, dtype=torch.int64, device=keep.device).scatter_(
            0, torch.where(flat, order, N), torch.arange(B * S, device=keep.device))[:N]
        padded_index = torch.where(flat, order, -1).view(B, S)
        inputs["position_ids"] = position_ids.expand(B, S)
        packed = {k: v.flatten(0, 1)[rows].unsqueeze(0) for k, v in inputs.items() if v is not None}
        state = PrefixState(layers, None, backend, None, self.layer_of, cu_seqlens=cu_seqlens, max_seqlen=S,
                            padded_index=padded_index)
        if pooled is not None:
            if not self.pooled_rows_only:
                raise ValueError(f"{self.name}'s last layer cannot compute pooled rows only")
            state.pooled_rows = padded_index[torch.arange(B, device=keep.device), pooled]
        out = self._run_with(state, attention_mask=packed_mask(keep.device), **packed)
        # every layer, not only those with a prefix: a layer outside the function would attend across sequences
        check_prefix_consumed(range(self.num_layers), state.served, self.name)
        hidden = out.last_hidden_state[0]
        filled = rows if pooled is None else torch.arange(B, device=keep.device) * S + pooled
        return hidden.new_zeros(B * S, hidden.shape[-1]).index_copy(0, filled, hidden).view(B, S, -1)

    def gradient_checkpointing(self, enable: bool) -> None:
        """Recompute each layer in backward instead of storing its activations.

        Non-reentrant checkpointing (``use_reentrant=False``) is required: the frozen backbone's inputs never
        require grad, so reentrant checkpointing would silently drop the prompt gradients (which is why PEFT
        refuses checkpointing with prefix tuning). The RNG state is restored for the recompute, so dropout
        masks, and therefore gradients, are the same as without checkpointing.
        """
        model = self.model
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
        if enable:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:  # transformers < 5.x
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            disable = getattr(model, "activation_checkpointing_disable", None)
            (disable or model.gradient_checkpointing_disable)()

    @property
    def is_gradient_checkpointing(self) -> bool:
        flag = "is_activation_checkpointing" if hasattr(self.model, "is_activation_checkpointing") \
            else "is_gradient_checkpointing"
        return bool(getattr(self.model, flag, False))

    def set_trainable(self, enable: bool) -> None:
        """Full fine-tuning. The backbone's own pooler (BERT's and RoBERTa's ``pooler``: dense + tanh over [CLS])
        stays frozen: the encoder pools the last hidden states itself, so that layer is never in the graph and
        could receive no gradient. Trainable, it would get none in one process (AdamW skips it) but zeros from the
        all-reduce of several processes (AdamW's weight decay would then shrink it): the saved weights would
        depend on the number of processes."""
        self.model.requires_grad_(enable)
        unused = getattr(self.model, "pooler", None)
        if enable and isinstance(unused, torch.nn.Module):
            unused.requires_grad_(False)

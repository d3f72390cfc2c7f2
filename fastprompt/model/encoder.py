"""PromptEncoder: a frozen Hugging Face encoder + trainable deep prompts + pooling, with encode/save/load."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fastprompt.choices import BACKENDS

from .attention import PrefixState, build_prefix_cache, register_attention
from .backbone import load_backbone, max_input_length
from .config import PromptConfig
from .device import resolve_device, warn_if_slow
from .pooling import MLP_MODES, Pooler
from .prefix import PrefixPrompt
from .resolve import model_reference

logger = logging.getLogger(__name__)

PREFIX_MODES = ("attention", "cache")
DEFAULT_TEMPLATE = 'This sentence : "[X]" means [MASK] .'  # PromptBERT's BERT template


class PromptEncoder(nn.Module):
    """A frozen backbone whose every attention layer sees trainable prefix keys/values.

    Build it with :meth:`from_pretrained` (a base model, optionally with a prompt checkpoint) or
    :meth:`load` (a prompt checkpoint that names its base model). Only the prompt, the [CLS] prompt and the
    pooler head are trainable; :meth:`save` writes only those.

    ``prefix_mode="attention"`` (default) hands each layer its prefix through fastprompt's registered
    attention function and the fused ``prefix_attention`` op; ``"cache"`` is the reference path that expands
    the prefix into a ``DynamicCache`` (what PEFT prefix tuning does) and runs the stock SDPA attention.
    """

    def __init__(self, backbone: nn.Module, tokenizer, prompt_config: PromptConfig | None = None, *,
                 pooler: str = "cls", mlp: str = "none", max_length: int | None = None,
                 template: str | None = None, attn_backend: str = "auto", prefix_mode: str = "attention",
                 base_model: str | None = None):
        super().__init__()
        if prefix_mode not in PREFIX_MODES:
            raise ValueError(f"prefix_mode must be one of {PREFIX_MODES}, got {prefix_mode!r}")
        if attn_backend not in BACKENDS:  # checked here: it is first used at the first forward
            raise ValueError(f"attn_backend must be one of {BACKENDS}, got {attn_backend!r}")
        cfg = backbone.config
        for attr in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
            if not hasattr(cfg, attr):
                raise ValueError(f"backbone config has no {attr!r}: only encoder models with standard "
                                 "self-attention (BERT, RoBERTa, ...) are supported")
        self.backbone = backbone.requires_grad_(False)
        if getattr(cfg, "use_cache", False):
            # an encoder keeps no key/value cache (the "cache" prefix mode asks for one explicitly); with
            # the config's default True, transformers warns under gradient checkpointing
            cfg.use_cache = False
        self.tokenizer = tokenizer
        self.base_model = base_model or getattr(cfg, "_name_or_path", None)
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads
        self.prompt_config = prompt_config
        self.prompt = (PrefixPrompt(prompt_config, self.num_layers, self.num_heads, self.head_dim)
                       if prompt_config is not None else None)
        self.cls_prompt = None
        if prompt_config is not None and prompt_config.cls_prompt:
            cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
            init = self.backbone.get_input_embeddings().weight[cls_id].detach().clone()
            self.cls_prompt = nn.Parameter(init)
        self.pooler = Pooler(pooler, self.hidden_size, mlp)
        if pooler == "mask" and template is None:
            template = DEFAULT_TEMPLATE
        self.template = template
        self._template_ids = self._parse_template(template) if template is not None else None
        shifted = prompt_config is not None and prompt_config.position_mode == "shifted"
        #: the most tokens one input may have (the backbone's position table), None when unbounded
        self.max_input_length = max_input_length(self.backbone, self.prompt_length if shifted else 0)
        self.check_max_length(max_length)
        self.max_length = max_length
        self.attn_backend = attn_backend
        self.prefix_mode = prefix_mode
        self._speed_checked = True
        if prompt_config is not None and prompt_config.init == "vocab":
            self._init_prefix_from_vocab()
        self._speed_checked = False  # the first user forward warns about a slow dtype/device combination

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike, *, prompt: str | os.PathLike | None = None,
                        prompt_config: PromptConfig | dict | None = None, pooler: str | None = None,
                        mlp: str | None = None, max_length: int | None = None, template: str | None = None,
                        attn_backend: str = "auto", prefix_mode: str = "attention",
                        torch_dtype: torch.dtype | None = None) -> "PromptEncoder":
        """Load a base encoder (local folder, installed model package, or hub id) and attach prompts.

        ``prompt``: a checkpoint folder written by :meth:`save`; its prompt, pooler and head are used (an
        explicit ``pooler``/``mlp``/``max_length`` overrides the saved one). Without ``prompt``, a fresh prompt
        is created from ``prompt_config`` (or none at all: the frozen model as is).
        """
        saved = None
        if prompt is not None:
            from .checkpoint import read_checkpoint_config

            saved = read_checkpoint_config(prompt)
            if prompt_config is not None:
                raise ValueError("pass either a prompt checkpoint or a prompt_config, not both")
            if saved["prompt_config"] is not None:
                prompt_config = PromptConfig.from_dict(saved["prompt_config"])
            pooler = pooler or saved["pooler"]
            mlp = mlp or saved["mlp"]
            max_length = max_length or saved.get("max_length")
            template = template or saved.get("template")
        elif isinstance(prompt_config, dict):
            prompt_config = PromptConfig.from_dict(prompt_config)
        attn = register_attention() if prefix_mode == "attention" else "sdpa"
        tokenizer, backbone = load_backbone(model_name_or_path, attn_implementation=attn, dtype=torch_dtype)
        encoder = cls(backbone, tokenizer, prompt_config, pooler=pooler or "cls", mlp=mlp or "none",
                      max_length=max_length, template=template, attn_backend=attn_backend,
                      prefix_mode=prefix_mode, base_model=model_reference(model_name_or_path))
        if saved is not None:
            from .checkpoint import load_checkpoint_weights

            load_checkpoint_weights(encoder, prompt, saved)
        return encoder

    @classmethod
    def load(cls, checkpoint_dir: str | os.PathLike, base_model: str | os.PathLike | None = None,
             **kwargs) -> "PromptEncoder":
        """Load a prompt checkpoint onto its base model (the one it names, or ``base_model``).

        A checkpoint names its base model by absolute path, installed package name or hub id; older ones may hold
        a relative path, which is tried from the current directory."""
        from .checkpoint import read_checkpoint_config

        saved = read_checkpoint_config(checkpoint_dir)
        if base_model is not None:
            return cls.from_pretrained(base_model, prompt=checkpoint_dir, **kwargs)
        base = saved["base_model"]
        if not base:
            raise ValueError(f"checkpoint {checkpoint_dir} names no base model; pass base_model=")
        try:
            return cls.from_pretrained(base, prompt=checkpoint_dir, **kwargs)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"prompt checkpoint {checkpoint_dir} was saved on base model {base!r}, which "
                                    f"cannot be loaded here ({exc}); pass base_model=PATH_OR_NAME (CLI: --model) "
                                    "to load the prompt onto a copy of that model") from exc

    def save(self, checkpoint_dir: str | os.PathLike, overwrite: bool = False) -> Path:
        """Write the prompt-only checkpoint (safetensors + JSON), atomically.

        ``checkpoint_dir`` may be new, an empty folder or an earlier fastprompt checkpoint (which is replaced);
        anything else (a file, a folder with other content) raises FileExistsError unless ``overwrite=True``,
        because saving replaces the whole folder."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, checkpoint_dir, overwrite=overwrite)

    def check_max_length(self, max_length: int | None) -> None:
        """ValueError when inputs of ``max_length`` tokens would not fit the backbone's position table."""
        if max_length is None:
            return
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
        limit = self.max_input_length
        if limit is not None and max_length > limit:
            shifted = self.prompt_config is not None and self.prompt_config.position_mode == "shifted"
            why = f" minus the {self.prompt_length} prompt positions of position_mode='shifted'" if shifted else ""
            raise ValueError(f"max_length {max_length} is more tokens than {self.base_model!r} can take: at most "
                             f"{limit} (its position embeddings{why})")

    def to(self, *args, **kwargs) -> "PromptEncoder":
        """``nn.Module.to`` that rejects a device this machine does not have with a clear message (torch would
        fail with an assertion or attribute error from deep inside)."""
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if device is not None:
            resolve_device(device)
        return super().to(*args, **kwargs)

    def gradient_checkpointing_enable(self, enable: bool = True) -> "PromptEncoder":
        """Recompute each backbone layer in backward instead of storing its activations.

        Non-reentrant checkpointing (``use_reentrant=False``) is required: the frozen backbone's inputs never
        require grad, so reentrant checkpointing would silently drop the prompt gradients (which is why PEFT
        refuses checkpointing with prefix tuning). The RNG state is restored for the recompute, so dropout
        masks, and therefore gradients, are the same as without checkpointing.
        """
        if not getattr(self.backbone, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(self.backbone).__name__} does not support gradient checkpointing")
        if enable:
            kwargs = {"use_reentrant": False}
            if hasattr(self.backbone, "activation_checkpointing_enable"):
                self.backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:  # transformers < 5.x
                self.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            disable = getattr(self.backbone, "activation_checkpointing_disable", None)
            (disable or self.backbone.gradient_checkpointing_disable)()
        return self

    @property
    def is_gradient_checkpointing(self) -> bool:
        flag = "is_activation_checkpointing" if hasattr(self.backbone, "is_activation_checkpointing") \
            else "is_gradient_checkpointing"
        return bool(getattr(self.backbone, flag, False))

    # ------------------------------------------------------------------ parameters
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The prompt, [CLS] prompt and pooler-head parameters (the backbone is frozen)."""
        return [p for p in self.parameters() if p.requires_grad]

    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint stores: all parameters and buffers outside the frozen backbone."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("backbone.")}

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    @property
    def prompt_length(self) -> int:
        return self.prompt_config.prompt_length if self.prompt_config is not None else 0

    # ------------------------------------------------------------------ tokenisation
    def _parse_template(self, template: str):
        if "[X]" not in template:
            raise ValueError(f"template must contain the sentence placeholder [X]: {template!r}")
        mask = self.tokenizer.mask_token
        if "[MASK]" in template and mask is None:
            raise ValueError("template uses [MASK] but the tokenizer has no mask token")
        before, after = template.replace("[MASK]", mask or "[MASK]").split("[X]", 1)
        enc = lambda s: self.tokenizer(s, add_special_tokens=False)["input_ids"] if s.strip() else []  # noqa: E731
        return enc(before.rstrip()), enc(after.lstrip())

    def tokenize(self, sentences: list[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """Token ids padded to the longest sentence (dynamic padding), truncated to ``max_length``."""
        _check_sentences(sentences)
        self.check_max_length(max_length)
        default = min(self.tokenizer.model_max_length, 512, self.max_input_length or 512)
        max_length = max_length or self.max_length or default
        if self._template_ids is None:
            return dict(self.tokenizer(sentences, padding=True, truncation=True, max_length=max_length,
                                       return_tensors="pt"))
        # Template: truncate the sentence, never the template, then wrap it with special tokens.
        before, after = self._template_ids
        room = max_length - len(before) - len(after) - len(self.tokenizer("")["input_ids"])
        if room < 1:
            raise ValueError(f"max_length {max_length} leaves no room for the sentence inside the template")
        ids = [before + s[:room] + after
               for s in self.tokenizer(sentences, add_special_tokens=False)["input_ids"]]
        # The special tokens a single sentence gets ([CLS] ... [SEP], <s> ... </s>): those of an empty input.
        empty = self.tokenizer("")["input_ids"]
        lead = 1 if len(empty) >= 2 else 0
        ids = [empty[:lead] + x + empty[lead:] for x in ids]
        return dict(self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"))

    # ------------------------------------------------------------------ forward
    def _position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """Explicit position ids where transformers' defaults would be wrong for us, else None."""
        shift = self.prompt_length if (self.prompt_config and self.prompt_config.position_mode == "shifted") else 0
        needs_ids = shift > 0 or self.cls_prompt is not None or self.prefix_mode == "cache"
        if not needs_ids:
            return None
        emb = self.backbone.embeddings
        if hasattr(emb, "create_position_ids_from_input_ids"):  # RoBERTa family: offsets by padding_idx
            return emb.create_position_ids_from_input_ids(input_ids, emb.padding_idx, shift)
        S = input_ids.shape[1]
        return (torch.arange(S, device=input_ids.device) + shift).unsqueeze(0).expand(input_ids.shape[0], -1)

    def _layer_prefixes(self):
        return self.prompt.layer_prefixes() if self.prompt is not None else [None] * self.num_layers

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None = None, *, _capture: dict | None = None) -> torch.Tensor:
        """Last-layer hidden states (B, S, hidden) of the prompted backbone."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be (batch, seq_len)")
        if not self._speed_checked:
            self._speed_checked = True
            device = self.device
            autocast = torch.is_autocast_enabled(device.type)
            warn_if_slow(torch.get_autocast_dtype(device.type) if autocast else self.backbone.dtype, device)
        kwargs = {"token_type_ids": token_type_ids, "position_ids": self._position_ids(input_ids, attention_mask)}
        if self.cls_prompt is not None:
            embeds = self.backbone.get_input_embeddings()(input_ids)
            cls = self.cls_prompt.to(embeds.dtype).expand(embeds.shape[0], 1, -1)
            kwargs["inputs_embeds"] = torch.cat([cls, embeds[:, 1:]], dim=1)
        else:
            kwargs["input_ids"] = input_ids
        layers = self._layer_prefixes()
        if self.prefix_mode == "attention":
            state = PrefixState(layers, attention_mask.bool(), self.attn_backend, _capture)
            out = self.backbone(attention_mask=attention_mask, fastprompt_state=state, **kwargs)
        elif self.prompt is None:
            out = self.backbone(attention_mask=attention_mask, **kwargs)
        else:
            B, P = input_ids.shape[0], self.prompt_length
            cache = build_prefix_cache(layers, B)
            mask = torch.cat([attention_mask.new_ones(B, P), attention_mask], dim=1)
            out = self.backbone(attention_mask=mask, past_key_values=cache, use_cache=True, **kwargs)
        return out.last_hidden_state

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled sentence embeddings (B, hidden); the pooler head follows its train/eval mode."""
        hidden = self.hidden_states(input_ids, attention_mask, token_type_ids)
        return self.pooler(hidden, attention_mask, input_ids, self.tokenizer.mask_token_id)

    @torch.no_grad()
    def _init_prefix_from_vocab(self):
        """'vocab' init: the frozen backbone's own keys/values of P random non-special vocabulary tokens."""
        if self.prompt_config.prefix_projection:
            raise ValueError("init='vocab' is not defined for a reparameterised (prefix_projection) prompt")
        if self.prefix_mode != "attention":
            raise ValueError("init='vocab' needs prefix_mode='attention'")
        special = set(self.tokenizer.all_special_ids)
        candidates = torch.tensor([i for i in range(len(self.tokenizer)) if i not in special])
        pick = candidates[torch.randperm(len(candidates))[: self.prompt_length]].unsqueeze(0).to(self.device)
        capture, prompt = {}, self.prompt
        self.prompt = None  # run the plain backbone
        try:
            self.hidden_states(pick, torch.ones_like(pick), _capture=capture)
        finally:
            self.prompt = prompt
        per_layer = [torch.stack(capture[i]) for i in range(prompt.stored_layers)]  # (2, H, P, D) each
        prompt.load_prefix_(torch.stack(per_layer).to(prompt.prefix.dtype))

    # ------------------------------------------------------------------ inference API
    @torch.inference_mode()
    def encode(self, sentences: list[str], batch_size: int = 64, normalize: bool = True,
               show_progress_bar: bool | None = None, max_length: int | None = None,
               convert_to_numpy: bool = True):
        """Embed sentences; returns (N, hidden) vectors in input order (L2-normalised by default).

        Batches are formed over sentences sorted by length, so little padding is computed.
        """
        _check_sentences(sentences)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if show_progress_bar is None:
            show_progress_bar = len(sentences) > batch_size and sys.stderr.isatty()
        was_training = self.training
        self.eval()
        try:
            order = np.argsort([-len(s) for s in sentences], kind="stable")
            chunks = []
            for start in tqdm(range(0, len(order), batch_size), desc="encode", disable=not show_progress_bar):
                batch = [sentences[i] for i in order[start:start + batch_size]]
                inputs = {k: v.to(self.device) for k, v in self.tokenize(batch, max_length).items()}
                emb = self(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids")).float()
                chunks.append(F.normalize(emb, dim=-1) if normalize else emb)
            out = torch.empty(len(sentences), chunks[0].shape[1], dtype=torch.float32, device=chunks[0].device)
            out[torch.as_tensor(order, device=out.device)] = torch.cat(chunks)
        finally:
            self.train(was_training)
        return out.cpu().numpy() if convert_to_numpy else out

    def similarity(self, a: list[str] | str, b: list[str] | str, batch_size: int = 64) -> np.ndarray:
        """Cosine similarity matrix (len(a), len(b)) between two lists of sentences."""
        a = [a] if isinstance(a, str) else a
        b = [b] if isinstance(b, str) else b
        return self.encode(a, batch_size) @ self.encode(b, batch_size).T


def _check_sentences(sentences):
    if isinstance(sentences, str):
        raise TypeError("expected a list of sentences, got a single string (wrap it in a list)")
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"expected a list of sentences, got {type(sentences).__name__}")
    if len(sentences) == 0:
        raise ValueError("no sentences to encode: the list is empty")
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise TypeError(f"sentence {i} is a {type(s).__name__}, not a str: {s!r:.80}")


__all__ = ["PromptEncoder", "MLP_MODES", "PREFIX_MODES", "DEFAULT_TEMPLATE"]

"""PromptEncoder: a frozen Hugging Face encoder + trainable deep prompts + pooling, with encode/save/load."""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fastprompt.choices import (
    BACKENDS,
    MLP_MODES,
    POOLER_HEADS,
    POOLERS,
    PREFIX_MODES,
    check_choice,
)
from fastprompt.messages import shown

from .attention import register_attention
from .backbone import Architecture, check_max_length, ensure_pad_token, load_backbone, max_input_length
from .config import PromptConfig
from .device import resolve_device, warn_if_slow
from .pooling import Pooler, check_pooler_fits
from .prefix import PrefixPrompt, init_prefix_from_vocab
from .promptbert import TemplateMixin
from .resolve import model_reference
from .soft_prompt import InputPrompt, cls_prompt_parameter, replace_first_token
from .template import DEFAULT_TEMPLATE, Template, wrap_batch

logger = logging.getLogger(__name__)


class PromptEncoder(TemplateMixin, nn.Module):
    """A frozen backbone whose every attention layer sees trainable prefix keys/values (and/or soft input tokens).

    Build it with :meth:`from_pretrained` (a base model, optionally with a prompt checkpoint) or
    :meth:`load` (a prompt checkpoint that names its base model). Only the prompt, the [CLS] prompt and the
    pooler head are trainable; :meth:`save` writes only those.

    PromptBERT (``docs/promptbert.md``, :class:`~fastprompt.model.promptbert.TemplateMixin`): ``template``,
    ``denoise``, ``topk``, OptiPrompt; ``mlm_transform`` (a module, with ``pooler="mask"``) is the supervised BERT
    runs' head, the checkpoint's MLM transform applied to the [MASK] state and to the template bias.

    ``prefix_mode="attention"`` (default) hands each layer its prefix through fastprompt's registered
    attention function and the fused ``prefix_attention`` op; ``"cache"`` is the reference path that expands
    the prefix into a ``DynamicCache`` (what PEFT prefix tuning does) and runs the stock SDPA attention.
    """

    def __init__(self, backbone: nn.Module, tokenizer, prompt_config: PromptConfig | None = None, *,
                 pooler: str = "cls", mlp: str = "none", max_length: int | None = None,
                 template: str | None = None, denoise: bool = False, topk: int = 200,
                 mlm_head: nn.Module | None = None, attn_backend: str = "auto",
                 prefix_mode: str = "attention", base_model: str | None = None,
                 mlm_transform: nn.Module | None = None):
        super().__init__()
        _check_options(pooler, mlp, attn_backend, prefix_mode)
        self.architecture = arch = Architecture(backbone)
        self.backbone = backbone.requires_grad_(False)
        self.backbone_trained = False  # full fine-tuning: checkpoints then hold the backbone (train_backbone)
        ensure_pad_token(tokenizer)
        self.tokenizer = tokenizer
        self.base_model = base_model or getattr(backbone.config, "_name_or_path", None)
        # the prefix's shape (num_heads: the key/value heads) and whether the token block is causal (a decoder)
        self.num_layers, self.hidden_size, self.head_dim = arch.num_layers, arch.hidden_size, arch.head_dim
        self.num_heads, self.causal = arch.num_heads, arch.causal
        # the prompt kinds: per-layer prefix, soft input tokens, [CLS] prompt
        self.prompt_config = prompt_config
        kind = prompt_config.prompt_type if prompt_config is not None else None
        self.prompt = (PrefixPrompt(prompt_config, self.num_layers, self.num_heads, self.head_dim)
                       if kind in ("prefix", "both") else None)
        self.input_prompt = None
        words = backbone.get_input_embeddings().weight
        if kind in ("input", "both"):
            self.input_prompt = InputPrompt(prompt_config.input_prompt_length, self.hidden_size)
            self.input_prompt.reset_parameters(prompt_config.init, prompt_config.init_std, words, tokenizer)
        self.cls_prompt = None
        if prompt_config is not None and prompt_config.cls_prompt:
            self.cls_prompt = cls_prompt_parameter(tokenizer, words)
        check_pooler_fits(pooler, self.causal, type(backbone).__name__)
        init_std = getattr(backbone.config, "initializer_range", 0.02)
        self.pooler = Pooler(pooler, self.hidden_size, mlp, init_std=init_std, mlm_transform=mlm_transform)
        self._init_templates(prompt_config, pooler, template, denoise, topk, mlm_head)  # PromptBERT's settings
        self.trust_remote_code = False  # set by from_pretrained
        #: the most tokens one input may have (the backbone's position table, less the positions a "shifted"
        #: prefix or an input prompt take), None when unbounded
        self.max_input_length = max_input_length(self.backbone, self._position_shift() + self.input_prompt_length)
        self.check_max_length(max_length)
        self.max_length = max_length
        self.attn_backend = attn_backend
        self.prefix_mode = prefix_mode
        self._speed_checked = True
        if self.prompt is not None and prompt_config.init == "vocab":
            init_prefix_from_vocab(self)
        self._speed_checked = False  # the first user forward warns about a slow dtype/device combination

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model_name_or_path: str | os.PathLike, *, prompt: str | os.PathLike | None = None,
                        prompt_config: PromptConfig | dict | None = None, pooler: str | None = None,
                        mlp: str | None = None, max_length: int | None = None, template: str | None = None,
                        denoise: bool | None = None, topk: int | None = None, attn_backend: str = "auto",
                        prefix_mode: str = "attention", torch_dtype: torch.dtype | None = None,
                        pooler_head: str | None = None, trust_remote_code: bool = False) -> "PromptEncoder":
        """Load a base encoder (local folder, installed model package, or hub id) and attach prompts.

        ``prompt``: a checkpoint folder written by :meth:`save`; its prompt, pooler and head are used (an
        explicit ``pooler``/``mlp``/``max_length`` overrides the saved one). Without ``prompt``, a fresh prompt
        is created from ``prompt_config`` (or none at all: the frozen model as is). ``template``/``denoise``:
        PromptBERT's template and template denoising (see :mod:`fastprompt.model.template`); ``None`` keeps
        the checkpoint's choice. ``topk``: k of the ``topk`` pooler (200, PromptBERT's Table 9; the MLM head is
        read from the model folder, see :mod:`fastprompt.model.mlm_head`). ``pooler_head``: ``new`` (default) or
        ``mlm_transform`` (the pooler head is the base model's pretrained MLM transform, PromptBERT's supervised
        BERT head); ``None`` keeps the checkpoint's. ``trust_remote_code``: let a model folder that names its own
        Python classes run them (:mod:`fastprompt.remote_code`; off: such a folder is refused).
        """
        saved, holds_backbone = None, False
        if prompt is not None:
            from .checkpoint import holds_backbone_weights, read_checkpoint_config

            saved = read_checkpoint_config(prompt)
            if prompt_config is not None:
                raise ValueError("pass either a prompt checkpoint or a prompt_config, not both")
            if saved["prompt_config"] is not None:
                prompt_config = PromptConfig.from_dict(saved["prompt_config"])
            pooler = pooler or saved["pooler"]
            mlp = mlp or saved["mlp"]
            max_length = max_length or saved.get("max_length")
            if (prompt_config is not None and prompt_config.optiprompt and template is not None
                    and template != saved.get("template")):
                raise ValueError(f"checkpoint {prompt} trained OptiPrompt vectors for the template "
                                 f"{saved.get('template')!r}; it cannot be used with another template")
            template = template or saved.get("template")
            denoise = saved.get("denoise", False) if denoise is None else denoise
            topk = topk or saved.get("topk")
            pooler_head = pooler_head or saved.get("pooler_head", "new")
            holds_backbone = holds_backbone_weights(saved)
        elif isinstance(prompt_config, dict):
            prompt_config = PromptConfig.from_dict(prompt_config)
        _check_options(pooler or "cls", mlp or "none", attn_backend, prefix_mode)  # before any weights load
        check_choice("pooler_head", pooler_head or "new", POOLER_HEADS)
        attn = register_attention() if prefix_mode == "attention" else "sdpa"
        # a fully fine-tuned checkpoint holds its backbone (and tokenizer) in the Hugging Face layout: load them
        # from there; the base model is only named
        tokenizer, backbone = load_backbone(prompt if holds_backbone else model_name_or_path,
                                            attn_implementation=attn, dtype=torch_dtype,
                                            trust_remote_code=trust_remote_code)
        mlm_head = mlm_transform = None
        if (pooler or "cls") == "topk":
            from .mlm_head import load_mlm_head
            from .resolve import resolve_model_path

            # the base model's head (a saved fine-tuned backbone has none), tied to this backbone's embeddings
            mlm_head = load_mlm_head(resolve_model_path(model_name_or_path), backbone,
                                     trust_remote_code=trust_remote_code)
        if (pooler_head or "new") == "mlm_transform":
            from .mlm_head import load_mlm_transform
            from .resolve import resolve_model_path

            # the base model's pretrained transform; a checkpoint's trained one replaces it below
            mlm_transform = load_mlm_transform(resolve_model_path(model_name_or_path), backbone,
                                               trust_remote_code=trust_remote_code)
        encoder = cls(backbone, tokenizer, prompt_config, pooler=pooler or "cls", mlp=mlp or "none",
                      max_length=max_length, template=template, denoise=bool(denoise), topk=topk or 200,
                      mlm_head=mlm_head, attn_backend=attn_backend, prefix_mode=prefix_mode,
                      base_model=model_reference(model_name_or_path), mlm_transform=mlm_transform)
        encoder.trust_remote_code = trust_remote_code  # what later loads from the same model (MLM head) follow
        if saved is not None:
            from .checkpoint import load_checkpoint_weights

            load_checkpoint_weights(encoder, prompt, saved, backbone=False)  # the backbone is loaded above
            encoder.backbone_trained = holds_backbone
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

        ``checkpoint_dir`` may be new, an empty folder or an earlier fastprompt checkpoint holding only its own
        files (which is replaced); anything else (a file, a folder with other content, a checkpoint folder that
        other files were put into) raises FileExistsError unless ``overwrite=True``, because saving replaces the
        whole folder."""
        from .checkpoint import save_checkpoint

        return save_checkpoint(self, checkpoint_dir, overwrite=overwrite)

    def check_max_length(self, max_length: int | None) -> None:
        """ValueError when inputs of ``max_length`` tokens would not fit the backbone's position table."""
        check_max_length(max_length, self.max_input_length, self.base_model, shifted=self._position_shift(),
                         soft_tokens=self.input_prompt_length)

    def to(self, *args, **kwargs) -> "PromptEncoder":
        """``nn.Module.to`` that rejects a device this machine does not have with a clear message (torch would
        fail with an assertion or attribute error from deep inside)."""
        device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if device is not None:
            resolve_device(device)
        return super().to(*args, **kwargs)

    @contextlib.contextmanager
    def using_weights(self, checkpoint_dir: str | os.PathLike) -> Iterator["PromptEncoder"]:
        """Run a block with a prompt checkpoint's weights in this encoder, then put the current ones back.

        Everything :meth:`save` writes (prompt, [CLS] prompt, pooler head and its BatchNorm statistics) is
        loaded in place, so an optimizer holding these parameters keeps working after the block; the
        train/eval mode is restored too. The checkpoint must describe a prompt of this encoder's shape.
        """
        from .checkpoint import holds_backbone_weights, load_checkpoint_weights, read_checkpoint_config

        saved = read_checkpoint_config(checkpoint_dir)
        current = {k: v.detach().clone() for k, v in self.prompt_state_dict().items()}
        if self.backbone_trained or holds_backbone_weights(saved):
            current.update({f"backbone.{k}": v.detach().clone() for k, v in self.backbone.state_dict().items()})
        was_training = self.training
        try:
            load_checkpoint_weights(self, checkpoint_dir, saved)  # inside: a load that fails half-way is undone
            yield self
        finally:
            with torch.no_grad():  # in place, so an optimizer holding these parameters keeps working
                for k, v in self.state_dict().items():
                    if k in current:
                        v.copy_(current[k])
            self.train(was_training)

    def gradient_checkpointing_enable(self, enable: bool = True) -> "PromptEncoder":
        """Recompute each backbone layer in backward instead of storing its activations (non-reentrant, so the
        prompt gradients survive: :meth:`~fastprompt.model.backbone.Architecture.gradient_checkpointing`)."""
        self.architecture.gradient_checkpointing(enable)
        return self

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.architecture.is_gradient_checkpointing

    # ------------------------------------------------------------------ parameters
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The prompt, [CLS] prompt and pooler-head parameters, and the backbone's after :meth:`train_backbone`."""
        return [p for p in self.parameters() if p.requires_grad]

    def train_backbone(self, enable: bool = True) -> "PromptEncoder":
        """Full fine-tuning: make the backbone's weights trainable (the MLM head of ``topk`` and the backbone's own
        pooler stay frozen: :meth:`~fastprompt.model.backbone.Architecture.set_trainable`). From then on
        :meth:`save` writes the backbone too, in the Hugging Face layout (``AutoModel.from_pretrained`` loads it)."""
        self.architecture.set_trainable(enable)
        self.backbone_trained = self.backbone_trained or enable
        return self

    def prompt_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything a checkpoint stores: all parameters and buffers outside the frozen backbone."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(("backbone.", "mlm_head."))}

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    @property
    def prompt_length(self) -> int:
        """Prefix positions per layer (0 without a prefix)."""
        has_prefix = self.prompt_config is not None and self.prompt_config.prompt_type != "input"
        return self.prompt_config.prompt_length if has_prefix else 0

    @property
    def input_prompt_length(self) -> int:
        """Soft tokens inserted into the input sequence (0 without an input prompt)."""
        return self.input_prompt.length if self.input_prompt is not None else 0

    # ------------------------------------------------------------------ tokenisation
    def model_max_tokens(self) -> int:
        """Longest sequence (special tokens included) the backbone's positions and tokenizer allow."""
        return min(self.tokenizer.model_max_length, 512, self.max_input_length or 512)

    def tokenize(self, sentences: list[str], max_length: int | None = None,
                 template: str | Template | None = None) -> dict[str, torch.Tensor]:
        """Token ids padded to the longest sequence of the batch (dynamic padding).

        Without a template, ``max_length`` bounds the whole sequence (special tokens included), as a Hugging Face
        tokenizer does. With one (the encoder's, or ``template``), it bounds the sentence's own tokens and the
        template comes on top, as in PromptBERT's code; the sentence is also cut so that the whole sequence fits
        :meth:`model_max_tokens`, and the template is never cut.
        """
        _check_sentences(sentences)
        self.check_max_length(max_length)
        max_length = max_length or self.max_length
        tpl = self._resolve_template(template)
        if tpl is None:
            return dict(self.tokenizer(sentences, padding=True, truncation=True,
                                       max_length=max_length or self.model_max_tokens(), return_tensors="pt"))
        ids = wrap_batch(self.tokenizer, tpl, list(sentences), max_length, self.model_max_tokens())
        return dict(self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"))

    # ------------------------------------------------------------------ forward
    def _position_shift(self) -> int:
        return self.prompt_length if (self.prompt_config and self.prompt_config.position_mode == "shifted") else 0

    def _position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """The backbone's position ids for these rows (:meth:`~fastprompt.model.backbone.Architecture.position_ids`)."""
        explicit = self.cls_prompt is not None or self.prefix_mode == "cache"  # the backbone gets embeddings, a cache
        return self.architecture.position_ids(input_ids, attention_mask, positions, shift=self._position_shift(),
                                              soft=self.input_prompt, explicit=explicit)

    def _layer_prefixes(self, batch_size: int | None = None):
        """Each layer's prefix (k, v); per example (batch_size, ...) under prompt dropout in training."""
        if self.prompt is None:
            return [None] * self.num_layers
        return self.prompt.layer_prefixes(batch_size=batch_size)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None = None, *, positions: torch.Tensor | None = None,
                      _capture: dict | None = None) -> torch.Tensor:
        """Last-layer hidden states (B, S, hidden) of the prompted backbone.

        ``positions`` (optional, (B, S)): each token's position counted from the first token; template denoising
        uses it to give a template fed alone the positions it has around a sentence.
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be (batch, seq_len)")
        if not self._speed_checked:
            self._speed_checked = True
            device = self.device
            autocast = torch.is_autocast_enabled(device.type)
            warn_if_slow(torch.get_autocast_dtype(device.type) if autocast else self.backbone.dtype, device)
        inputs = {"position_ids": self._position_ids(input_ids, attention_mask, positions)}
        if self.cls_prompt is None and self.input_prompt is None and self.template_words is None:
            inputs["input_ids"] = input_ids
        else:  # the input-level prompts: [CLS] prompt, OptiPrompt's template words, soft input tokens
            embeds = self.backbone.get_input_embeddings()(input_ids)
            if self.cls_prompt is not None:
                embeds = replace_first_token(embeds, self.cls_prompt)
            if self.template_words is not None:
                embeds = self.template_words.apply(embeds, input_ids, attention_mask)
            if self.input_prompt is not None:
                embeds = self.input_prompt.insert(embeds)
                attention_mask = self.input_prompt.insert_mask(attention_mask)
                if token_type_ids is not None:
                    token_type_ids = self.input_prompt.insert_mask(token_type_ids, fill=0)
            inputs["inputs_embeds"] = embeds
        hidden = self.architecture.forward(attention_mask, self._layer_prefixes(attention_mask.shape[0]),
                                           prefix_mode=self.prefix_mode, backend=self.attn_backend,
                                           capture=_capture, token_type_ids=token_type_ids, **inputs)
        return self.input_prompt.remove(hidden) if self.input_prompt is not None else hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, *,
                template: str | Template | None = None, head: bool = True) -> torch.Tensor:
        """Pooled sentence embeddings (B, hidden); the pooler head follows its train/eval mode.

        ``head=False`` returns the vectors before the head: training applies the head on the loss side, over
        the whole global batch (see :class:`~fastprompt.model.pooling.Pooler`).

        ``template``: the template the rows were tokenised with, when not the encoder's own (PromptBERT's second
        view); it decides where the [MASK] is and which template bias denoising subtracts.
        """
        hidden = self.hidden_states(input_ids, attention_mask, token_type_ids)
        return self.pool(hidden, input_ids, attention_mask, template=template, head=head)

    def pool(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
             template: str | Template | None = None, denoise: bool | None = None,
             head: bool = True) -> torch.Tensor:
        """Hidden states (B, S, hidden) of rows built with ``template`` -> sentence vectors (B, hidden).

        ``denoise`` overrides the encoder's setting (``None`` keeps it); ``head=False`` skips the pooler head
        (training applies it on the loss side), except an ``mlm_transform`` head, which acts per row before
        denoising and so always here.
        """
        tpl = self._resolve_template(template)
        vec = self.pooler.select(hidden, attention_mask, input_ids, self.tokenizer.mask_token_id,
                                 mask_positions=self._mask_positions(tpl, attention_mask))
        vec = self.pooler.transform(vec)  # the mlm_transform head: on the [MASK] state and on the bias alike
        vec = self._denoise_and_topk(vec, tpl, attention_mask, denoise)
        return self.pooler.apply_head(vec) if head else vec

    # ------------------------------------------------------------------ inference API
    @torch.inference_mode()
    def encode(self, sentences: list[str], batch_size: int = 64, normalize: bool = True,
               show_progress_bar: bool | None = None, max_length: int | None = None,
               convert_to_numpy: bool = True, *, task_metadata=None, hf_split: str | None = None,
               hf_subset: str | None = None, prompt_type=None, precision: str | None = None, dim: int | None = None,
               **kwargs):
        """Embed sentences; returns (N, hidden) vectors in input order (L2-normalised by default).

        ``dim``: keep the first ``dim`` coordinates of each vector (then L2-normalise, by default): a Matryoshka
        embedding of a prompt trained with ``matryoshka_dims`` (sentence-transformers' ``truncate_dim``).

        Batches are formed over sentences sorted by length, so little padding is computed.
        The keywords evaluation harnesses pass are accepted: MTEB's ``task_metadata``, ``hf_split``, ``hf_subset``
        and ``prompt_type`` (a prompt's embedding does not depend on them), ``precision`` ("float32" only); any
        other keyword is ignored with a warning.
        """
        if precision not in (None, "float32"):
            raise ValueError(f"precision {precision!r} is not supported: embeddings are float32")
        if kwargs:
            logger.warning("encode ignores the keyword arguments %s", ", ".join(sorted(kwargs)))
        _check_sentences(sentences)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be a positive integer (the coordinates to keep), got {shown(dim)}")
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
                if dim is not None:
                    if dim > emb.shape[1]:
                        raise ValueError(f"dim={dim} is more than the {emb.shape[1]} dimensions of the embeddings")
                    emb = emb[:, :dim]
                chunks.append(F.normalize(emb, dim=-1) if normalize else emb)
            out = torch.empty(len(sentences), chunks[0].shape[1], dtype=torch.float32, device=chunks[0].device)
            out[torch.as_tensor(order, device=out.device)] = torch.cat(chunks)
        finally:
            self.train(was_training)
        bad = (~torch.isfinite(out).all(dim=1)).nonzero().flatten().tolist()
        if bad:  # a vector of NaNs ranks and compares as garbage downstream: never hand one out
            raise ValueError(f"{len(bad)} of {len(sentences)} sentences encode to NaN or infinite vectors (the first: "
                             f"sentence {bad[0]}, {shown(sentences[bad[0]])}): the prompt or the backbone holds "
                             "non-finite values (from a run that diverged?); load an earlier checkpoint")
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


def _check_options(pooler: str, mlp: str, attn_backend: str, prefix_mode: str) -> None:
    """Reject a typo in a closed choice with the list of valid values (the sets live in fastprompt.choices)."""
    check_choice("pooler", pooler, POOLERS)
    check_choice("mlp", mlp, MLP_MODES)
    check_choice("attn_backend", attn_backend, BACKENDS)
    check_choice("prefix_mode", prefix_mode, PREFIX_MODES)


__all__ = ["PromptEncoder", "MLP_MODES", "PREFIX_MODES", "DEFAULT_TEMPLATE"]

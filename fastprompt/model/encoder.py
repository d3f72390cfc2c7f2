"""PromptEncoder: a frozen Hugging Face backbone + trainable prompts + a pooler, with encode and similarity.

The pieces live beside it: tokenisation and the inference API (``tokenize``, ``encode``, ``similarity``) in
:mod:`.encoding`, how a prompt enters the backbone's architecture in :mod:`.backbone` (and the attention
functions in :mod:`.attention`), the prompt kinds in :mod:`.prefix` and :mod:`.soft_prompt`, the poolers in
:mod:`.pooling`, PromptBERT's templates, denoising and OptiPrompt in :mod:`.promptbert` (tokenisation of templates:
:mod:`.template`), checkpoints in :mod:`.checkpoint`.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from fastprompt.choices import BACKENDS, MLP_MODES, POOLERS, PREFIX_MODES, check_choice

from .arch.positions import check_max_length, max_input_length
from .backbone import Architecture
from .checkpoint import CheckpointMixin
from .config import PromptConfig
from .device import resolve_device, warn_if_slow
from .encoding import EncodingMixin
from .pooling import Pooler, check_pooler_fits
from .prefix import PrefixPrompt, init_prefix_from_vocab
from .promptbert import TemplateMixin
from .soft_prompt import InputPrompt, cls_prompt_parameter, replace_first_token
from .template import DEFAULT_TEMPLATE, Template, eos_token_id
from .tokenizers import ensure_pad_token

logger = logging.getLogger(__name__)


class PromptEncoder(CheckpointMixin, TemplateMixin, EncodingMixin, nn.Module):
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
                 mlm_transform: nn.Module | None = None, append_eos: bool = False):
        super().__init__()
        self._check_options(pooler, mlp, attn_backend, prefix_mode)
        self.architecture = arch = Architecture(backbone)
        self.backbone = backbone.requires_grad_(False)
        self.backbone_trained = False  # full fine-tuning: checkpoints then hold the backbone (train_backbone)
        #: the ``LoraConfig`` of the LoRA adapters in the backbone (:meth:`add_lora`), None without them
        self.lora = None
        ensure_pad_token(tokenizer)
        self.tokenizer = tokenizer
        self._mask_token_id = tokenizer.mask_token_id  # an int for the forward: the tokenizer's lookup breaks a graph
        self.base_model = base_model or getattr(backbone.config, "_name_or_path", None)
        #: end every sequence with the tokenizer's EOS (decoder embedders pool it: :meth:`tokenize`)
        self.append_eos = bool(append_eos)
        self._eos_id = eos_token_id(tokenizer, self.base_model) if self.append_eos else None
        self._special_tokens: list[int] | None = None  # what an empty sentence becomes (special_tokens())
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
        self.packed = False  # pack_sequences(): run the batch's real tokens only
        self._speed_checked = True
        if self.prompt is not None and prompt_config.init == "vocab":
            init_prefix_from_vocab(self)
        self._speed_checked = False  # the first user forward warns about a slow dtype/device combination

    @staticmethod
    def _check_options(pooler: str, mlp: str, attn_backend: str, prefix_mode: str) -> None:
        """Reject a typo in a closed choice with the list of valid values (the sets live in fastprompt.choices)."""
        check_choice("pooler", pooler, POOLERS)
        check_choice("mlp", mlp, MLP_MODES)
        check_choice("attn_backend", attn_backend, BACKENDS)
        check_choice("prefix_mode", prefix_mode, PREFIX_MODES)

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

    def gradient_checkpointing_enable(self, enable: bool = True) -> "PromptEncoder":
        """Recompute each backbone layer in backward instead of storing its activations (non-reentrant, so the
        prompt gradients survive: :meth:`~fastprompt.model.backbone.Architecture.gradient_checkpointing`)."""
        self.architecture.gradient_checkpointing(enable)
        return self

    def pack_sequences(self, enable: bool = True) -> "PromptEncoder":
        """Run each batch's real tokens only: the rows' tokens back to back in one sequence through every layer
        (:meth:`~fastprompt.model.backbone.Architecture.forward_packed`), the fused attention keeping the sequences
        apart with their offsets. The same maths as the padded batch without the padding's work; a batch without
        padding runs as it is. ValueError on a backbone or setting where that cannot hold
        (:meth:`packing_refusal`)."""
        refusal = self.packing_refusal() if enable else None
        if refusal is not None:
            raise ValueError(f"packed sequences are not available: {refusal}; run without packing")
        self.packed = bool(enable)
        return self

    def packing_refusal(self) -> str | None:
        """Why :meth:`pack_sequences` cannot apply to this encoder, or None when it can."""
        if self.prefix_mode != "attention":
            return "prefix_mode='cache' hands the prefix over as a key/value cache, which has no packed layout"
        return self.architecture.packing_refusal()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.architecture.is_gradient_checkpointing

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The prompt, [CLS] prompt and pooler-head parameters, and the backbone's after :meth:`train_backbone`."""
        return [p for p in self.parameters() if p.requires_grad]

    def train_backbone(self, enable: bool = True) -> "PromptEncoder":
        """Full fine-tuning: make the backbone's weights trainable (the MLM head of ``topk`` and the backbone's own
        pooler stay frozen: :meth:`~fastprompt.model.backbone.Architecture.set_trainable`). From then on
        :meth:`save` writes the backbone too, in the Hugging Face layout (``AutoModel.from_pretrained`` loads it)."""
        if enable and self.lora is not None:
            raise ValueError("this encoder's backbone holds LoRA adapters: training its weights too would train a "
                             "second copy of the same weights; use one of them")
        self.architecture.set_trainable(enable)
        self.backbone_trained = self.backbone_trained or enable
        return self

    def add_lora(self, *, rank: int, alpha: float, dropout: float = 0.0,
                 targets: list[str] | None = None) -> "PromptEncoder":
        """LoRA: inject PEFT's low-rank adapters into the backbone's linear layers (``targets``: module names; None:
        the architecture family's, :attr:`fastprompt.model.arch.Family.lora_targets`); only they train in the
        backbone. From then on :meth:`save` writes them in PEFT's layout (:mod:`fastprompt.model.lora`)."""
        from .attention import layer_list
        from .lora import add_lora

        if self.lora is not None:
            raise ValueError("this encoder's backbone already holds LoRA adapters")
        if self.backbone_trained:
            raise ValueError("this encoder's backbone is fully fine-tuned (train_backbone): LoRA adapters on it "
                             "would train a second copy of the same weights; use one of them")
        self.lora = add_lora(self.backbone, layer_list(self.backbone, self.num_layers), rank=rank, alpha=alpha,
                             dropout=dropout, targets=targets, base_model=self.base_model)
        return self

    def merge_lora(self) -> "PromptEncoder":
        """Fold the LoRA adapters into the backbone's weights (same outputs, plain linear layers): the encoder then
        is a fine-tuned backbone (``backbone_trained``), saved in the Hugging Face layout. No-op without LoRA."""
        from .lora import merge_lora

        if self.lora is not None:
            merge_lora(self.backbone)
            self.lora = None
            self.backbone_trained = True
        return self

    @property
    def device(self) -> torch.device:
        return next(self.backbone.parameters()).device

    @property
    def prompt_length(self) -> int:
        """Prefix positions per layer (0 without a prefix)."""
        has_prefix = self.prompt_config is not None and self.prompt_config.prompt_type in ("prefix", "both")
        return self.prompt_config.prompt_length if has_prefix else 0

    @property
    def input_prompt_length(self) -> int:
        """Soft tokens inserted into the input sequence (0 without an input prompt)."""
        return self.input_prompt.length if self.input_prompt is not None else 0

    def _position_shift(self) -> int:
        return self.prompt_length if (self.prompt_config and self.prompt_config.position_mode == "shifted") else 0

    def _position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      positions: torch.Tensor | None = None, explicit: bool = False) -> torch.Tensor | None:
        """The backbone's position ids for these rows (:meth:`~fastprompt.model.backbone.Architecture.position_ids`);
        ``explicit``: never None (a packed batch needs them)."""
        # the backbone gets embeddings (no ids to derive positions from) or a cache
        explicit = explicit or self.cls_prompt is not None or self.prefix_mode == "cache"
        return self.architecture.position_ids(input_ids, attention_mask, positions, shift=self._position_shift(),
                                              soft=self.input_prompt, explicit=explicit)

    def _layer_prefixes(self, batch_size: int | None = None):
        """Each layer's prefix (k, v); per example (batch_size, ...) under prompt dropout in training."""
        if self.prompt is None:
            return [None] * self.num_layers
        return self.prompt.layer_prefixes(batch_size=batch_size)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      token_type_ids: torch.Tensor | None = None, *, positions: torch.Tensor | None = None,
                      pooled: torch.Tensor | None = None, lengths: Sequence[int] | None = None,
                      _capture: dict | None = None) -> torch.Tensor:
        """Last-layer hidden states (B, S, hidden) of the prompted backbone.

        ``positions`` (optional, (B, S)): each token's position counted from the first token; template denoising
        uses it to give a template fed alone the positions it has around a sentence.

        ``pooled`` (optional, (B,)): the one position of each row that will be read (:meth:`_pooled_positions`); a
        packed batch then computes the last layer at those rows only, and the other rows are zero.

        ``lengths`` (optional): each row's number of real tokens, known on the host (``Batch.lengths``, what the
        trainer passes): a packed forward then never reads the mask back from the GPU (docs/gpu.md, "The host
        path"); without it, it reads the real-token count from the mask.
        """
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                             f"{tuple(attention_mask.shape)} must both be (batch, seq_len)")
        # (not while torch.compile traces: the flag's flip would be a guard, and compile the forward again)
        if not torch.compiler.is_compiling() and not self._speed_checked:
            self._speed_checked = True
            device = self.device
            autocast = torch.is_autocast_enabled(device.type)
            warn_if_slow(torch.get_autocast_dtype(device.type) if autocast else self.backbone.dtype, device)
        if lengths is not None and len(lengths) != attention_mask.shape[0]:
            raise ValueError(f"lengths has {len(lengths)} entries for {attention_mask.shape[0]} rows")
        # whether the batch has padding matters to a packed encoder only (no host read otherwise)
        packed = self.packed and _capture is None and (pooled is not None or _has_padding(attention_mask, lengths))
        inputs = {"position_ids": self._position_ids(input_ids, attention_mask, positions, explicit=packed)}
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
                lengths = None if lengths is None else [n + self.input_prompt.length for n in lengths]
                if token_type_ids is not None:
                    token_type_ids = self.input_prompt.insert_mask(token_type_ids, fill=0)
            inputs["inputs_embeds"] = embeds
        layers = self._layer_prefixes(attention_mask.shape[0])
        if packed:
            hidden = self.architecture.forward_packed(attention_mask, layers, backend=self.attn_backend,
                                                      token_type_ids=token_type_ids, pooled=pooled,
                                                      num_tokens=None if lengths is None else sum(lengths), **inputs)
        else:
            hidden = self.architecture.forward(attention_mask, layers, prefix_mode=self.prefix_mode,
                                               backend=self.attn_backend, capture=_capture,
                                               token_type_ids=token_type_ids, **inputs)
        return self.input_prompt.remove(hidden) if self.input_prompt is not None else hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None, *,
                template: str | Template | None = None, head: bool = True,
                lengths: Sequence[int] | None = None) -> torch.Tensor:
        """Pooled sentence embeddings (B, hidden); the pooler head follows its train/eval mode.

        ``head=False`` returns the vectors before the head: training applies the head on the loss side, over
        the whole global batch (see :class:`~fastprompt.model.pooling.Pooler`).

        ``template``: the template the rows were tokenised with, when not the encoder's own (PromptBERT's second
        view); it decides where the [MASK] is and which template bias denoising subtracts.

        ``lengths``: each row's number of real tokens, known on the host (see :meth:`hidden_states`).
        """
        hidden = self.hidden_states(input_ids, attention_mask, token_type_ids, lengths=lengths,
                                    pooled=self._pooled_positions(input_ids, attention_mask, template))
        return self.pool(hidden, input_ids, attention_mask, template=template, head=head)

    def _pooled_positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          template: str | Template | None = None) -> torch.Tensor | None:
        """(B,) the one position of each row the pooler reads, where a packed batch's last layer can compute those
        rows only; else None (mean pooling, soft input tokens that move the positions, an unpacked encoder)."""
        if not (self.packed and self.architecture.pooled_rows_only) or self.input_prompt is not None:
            return None
        tpl = self._resolve_template(template)
        return self.pooler.positions(attention_mask, input_ids, self._mask_token_id,
                                     mask_positions=self._mask_positions(tpl, attention_mask))

    def pool(self, hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
             template: str | Template | None = None, denoise: bool | None = None,
             head: bool = True) -> torch.Tensor:
        """Hidden states (B, S, hidden) of rows built with ``template`` -> sentence vectors (B, hidden).

        ``denoise`` overrides the encoder's setting (``None`` keeps it); ``head=False`` skips the pooler head
        (training applies it on the loss side), except an ``mlm_transform`` head, which acts per row before
        denoising and so always here.
        """
        tpl = self._resolve_template(template)
        vec = self.pooler.select(hidden, attention_mask, input_ids, self._mask_token_id,
                                 mask_positions=self._mask_positions(tpl, attention_mask))
        vec = self.pooler.transform(vec)  # the mlm_transform head: on the [MASK] state and on the bias alike
        vec = self._denoise_and_topk(vec, tpl, attention_mask, denoise)
        return self.pooler.apply_head(vec) if head else vec


def _has_padding(attention_mask: torch.Tensor, lengths: Sequence[int] | None) -> bool:
    """Whether a row of the batch is shorter than its width: from the host lengths, else read from the mask."""
    if lengths is not None:
        return any(n < attention_mask.shape[1] for n in lengths)
    return not bool(attention_mask.bool().all())  # host read: without host lengths only


__all__ = ["PromptEncoder", "MLP_MODES", "PREFIX_MODES", "DEFAULT_TEMPLATE"]

"""PromptEncoder: a frozen Hugging Face backbone + trainable prompts + a pooler, with encode and similarity.

The pieces live beside it: how a prompt enters the backbone's architecture in :mod:`.backbone` (and the attention
functions in :mod:`.attention`), the prompt kinds in :mod:`.prefix` and :mod:`.soft_prompt`, the poolers in
:mod:`.pooling`, PromptBERT's templates, denoising and OptiPrompt in :mod:`.promptbert` (tokenisation of templates:
:mod:`.template`), checkpoints in :mod:`.checkpoint`.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from fastprompt.choices import BACKENDS, MLP_MODES, POOLERS, PREFIX_MODES, check_choice
from fastprompt.host_sync import host_side
from fastprompt.messages import shown

from .backbone import Architecture, check_max_length, ensure_pad_token, max_input_length
from .checkpoint import CheckpointMixin
from .config import PromptConfig
from .device import resolve_device, warn_if_slow
from .pooling import Pooler, check_pooler_fits
from .prefix import PrefixPrompt, init_prefix_from_vocab
from .promptbert import TemplateMixin
from .soft_prompt import InputPrompt, cls_prompt_parameter, replace_first_token
from .template import DEFAULT_TEMPLATE, Template, end_with_eos, eos_token_id, wrap_batch

logger = logging.getLogger(__name__)


class PromptEncoder(CheckpointMixin, TemplateMixin, nn.Module):
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
        self.architecture.set_trainable(enable)
        self.backbone_trained = self.backbone_trained or enable
        return self

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

    def model_max_tokens(self) -> int:
        """Longest sequence (special tokens included) the backbone's positions and tokenizer allow."""
        return min(self.tokenizer.model_max_length, 512, self.max_input_length or 512)

    def tokenize(self, sentences: list[str], max_length: int | None = None,
                 template: str | Template | None = None) -> dict[str, torch.Tensor]:
        """Token ids padded to the longest sequence of the batch (dynamic padding), on the tokenizer's
        ``padding_side``.

        Without a template, ``max_length`` bounds the whole sequence (special tokens included), as a Hugging Face
        tokenizer does. With one (the encoder's, or ``template``), it bounds the sentence's own tokens and the
        template comes on top, as in PromptBERT's code; the sentence is also cut so that the whole sequence fits
        :meth:`model_max_tokens`, and the template is never cut. With ``append_eos`` every sequence ends with the
        tokenizer's EOS (appended unless already last; the text is cut one token earlier so the EOS always fits;
        with a template it counts as one of the template's tokens).
        """
        _check_sentences(sentences)
        self.check_max_length(max_length)
        max_length = max_length or self.max_length
        tpl = self._resolve_template(template)
        if tpl is None and max_length is not None:
            self._check_room_for_text(max_length)
        if tpl is not None:
            ids = wrap_batch(self.tokenizer, tpl, list(sentences), max_length, self.model_max_tokens())
        elif self.append_eos:
            limit = max_length or self.model_max_tokens()
            ids = self.tokenizer(sentences, truncation=True, max_length=limit)["input_ids"]
            ids = [end_with_eos(row, self._eos_id, limit) for row in ids]
        else:
            return dict(self.tokenizer(sentences, padding=True, truncation=True,
                                       max_length=max_length or self.model_max_tokens(), return_tensors="pt"))
        return dict(self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"))

    def special_tokens(self) -> list[int]:
        """The token ids an empty sentence becomes without a template: the special tokens the tokenizer adds to
        every sentence (and the EOS with ``append_eos``). Computed once."""
        if self._special_tokens is None:
            empty = list(self.tokenizer("")["input_ids"])
            self._special_tokens = end_with_eos(empty, self._eos_id, len(empty) + 1) if self.append_eos else empty
        return list(self._special_tokens)

    def _check_room_for_text(self, max_length: int) -> None:
        """ValueError when ``max_length`` (special tokens included) leaves no token of text: every sentence would be
        the tokenizer's special tokens alone and encode to one vector (``max_length=2`` on BERT: ``[CLS] [SEP]``)."""
        special = len(self.special_tokens())
        if max_length <= special:
            raise ValueError(f"max_length={max_length} leaves no room for text: {self.base_model}'s tokenizer adds "
                             f"{special} special token(s) to every sentence, so every sentence would be "
                             f"those alone and encode to the same vector; set max_length >= {special + 1}"
                             " (it counts the special tokens)")

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

    @torch.inference_mode()
    def encode(self, sentences: list[str], batch_size: int = 64, normalize: bool = True,
               show_progress_bar: bool | None = None, max_length: int | None = None,
               convert_to_numpy: bool = True, *, task_metadata=None, hf_split: str | None = None,
               hf_subset: str | None = None, prompt_type=None, precision: str | None = None, dim: int | None = None,
               **kwargs):
        """Embed sentences; returns (N, hidden) vectors in input order (L2-normalised by default).

        ``dim``: keep the first ``dim`` coordinates of each vector (then L2-normalise, by default): a Matryoshka
        embedding of a prompt trained with ``matryoshka_dims`` (sentence-transformers' ``truncate_dim``).

        Batches are formed in :meth:`encoding_order` (by token count), so little padding is computed.
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
            order = self.encoding_order(sentences, max_length)
            chunks = []
            for start in tqdm(range(0, len(order), batch_size), desc="encode", disable=not show_progress_bar):
                batch = [sentences[i] for i in order[start:start + batch_size]]
                inputs = self.tokenize(batch, max_length)
                lengths = None  # a padded forward reads none (and a compiled one would recompile per list length)
                if self.packed:
                    with host_side():  # the tokenizer's fresh CPU tensor: the packed forward reads no mask back
                        lengths = inputs["attention_mask"].sum(1).tolist()
                inputs = {k: v.to(self.device) for k, v in inputs.items()}
                emb = self(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"),
                           lengths=lengths).float()
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

    def encoding_order(self, sentences: list[str], max_length: int | None = None) -> np.ndarray:
        """The order :meth:`encode` batches ``sentences`` in: by token count, longest first (ties in input order),
        so the rows of a batch are about equally long and little padding is computed. The sentences are tokenised
        in chunks to count their tokens (fast next to the model). Ordered by characters instead, about a quarter of
        the positions of STS batches were padding: digits and punctuation take more tokens than their length
        suggests (measured over the seven STS tasks, 32 tokens, batches of 64: 76% real tokens with MiniLM's
        tokenizer, 69% with SmolLM2's; by token count, 99.8%)."""
        counts = [self.tokenize(sentences[i:i + 4096], max_length)["attention_mask"].sum(1)
                  for i in range(0, len(sentences), 4096)]
        return np.argsort(-torch.cat(counts).numpy(), kind="stable")

    def similarity(self, a: list[str] | str, b: list[str] | str, batch_size: int = 64) -> np.ndarray:
        """Cosine similarity matrix (len(a), len(b)) between two lists of sentences."""
        a = [a] if isinstance(a, str) else a
        b = [b] if isinstance(b, str) else b
        return self.encode(a, batch_size) @ self.encode(b, batch_size).T


def _has_padding(attention_mask: torch.Tensor, lengths: Sequence[int] | None) -> bool:
    """Whether a row of the batch is shorter than its width: from the host lengths, else read from the mask."""
    if lengths is not None:
        return any(n < attention_mask.shape[1] for n in lengths)
    return not bool(attention_mask.bool().all())  # host read: without host lengths only


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

"""Poolers: how the last hidden states become one sentence vector, plus the optional training heads."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from torch import nn

from fastprompt.choices import FIRST_TOKEN_POOLERS, MLP_MODES, POOLERS, check_choice

__all__ = ["Pooler", "POOLERS", "MLP_MODES", "NativePooling", "bn_mlp_head", "check_pooler_fits", "init_linear_layers",
           "native_pooling", "topk_token_representation"]


class Pooler(nn.Module):
    """Pick the sentence vector and optionally apply a trainable head.

    pooler: "cls" ([CLS] state), "cls_before_pooler" ([CLS] state, never a head), "mean" (mean over real
    tokens), "mask" (state of the template's [MASK] token: PromptBERT's template representation), "topk"
    (PromptBERT's Eq. 3: the static embeddings of the k tokens the MLM head ranks highest at the [MASK],
    weighted by their normalised probabilities; see :func:`topk_token_representation`), "bn_mlp"
    ([CLS] state with D2CSE's BatchNorm MLP head), "last" (the state of each row's last real token, left or
    right padding alike: a causal decoder's only token that has seen the whole input, as decoder embedders pool).
    mlp: when the head is applied: "none", "train" (SimCSE's ``mlp_only_train``: training only) or "always".
    The head is SimCSE's Linear + Tanh for cls/mean/mask and DiffCSE's projection MLP for bn_mlp
    (:func:`bn_mlp_head`), its Linear weights drawn from N(0, ``init_std``) with zero biases: what
    SimCSE, DCPCSE/PromCSE, PromptBERT and DiffCSE get from Hugging Face's ``init_weights()`` (std = the
    backbone's ``initializer_range``, 0.02 for BERT and RoBERTa). ``mlm_transform`` (a module, pooler "mask"
    only) is the head instead: the checkpoint's pretrained MLM transform, applied by :meth:`transform` to the
    [MASK] state and to the template bias before denoising subtracts one from the other (PromptBERT's
    supervised BERT runs), not by :meth:`apply_head`.

    ``forward`` = :meth:`apply_head` of :meth:`pool`. Training calls the two apart: the encoder returns
    :meth:`pool`'s vectors and the trainer applies the head over the whole global batch (every view, every
    process), so a head that mixes rows (BatchNorm) sees the same batch however the step is split.
    """

    def __init__(self, pooler: str, hidden_size: int, mlp: str = "none", init_std: float = 0.02,
                 mlm_transform: nn.Module | None = None):
        super().__init__()
        check_choice("pooler", pooler, POOLERS)
        check_choice("mlp", mlp, MLP_MODES)
        if pooler == "cls_before_pooler" and mlp != "none":
            raise ValueError("pooler 'cls_before_pooler' never uses a head; use pooler 'cls' with an mlp mode")
        self.pooler, self.mlp = pooler, mlp
        self.head_kind = "mlm_transform" if mlm_transform is not None else "new"
        if mlm_transform is not None:
            if pooler != "mask" or mlp == "none":
                raise ValueError(f"pooler_head mlm_transform transforms the template's [MASK] state: it needs pooler "
                                 f"'mask' and mlp 'train' or 'always', got pooler {pooler!r}, mlp {mlp!r}")
            self.head = mlm_transform  # pretrained: not re-initialised
        elif mlp == "none":
            self.head = None
        elif pooler == "bn_mlp":
            self.head = bn_mlp_head(hidden_size)
        else:
            self.head = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.Tanh())
        if self.head is not None and self.head_kind == "new":
            init_linear_layers(self.head, init_std)

    def select(self, hidden: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None,
               mask_token_id: int | None = None, mask_positions: torch.Tensor | None = None) -> torch.Tensor:
        """The sentence vector before the head: (B, S, hidden) states -> (B, hidden).

        ``mask_positions`` ((B,) indices, optional) locates the template's [MASK] directly; without it the
        first mask token of each row is taken.
        """
        if self.pooler == "mean":
            m = attention_mask.to(hidden.dtype).unsqueeze(-1)
            return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
        where = self.positions(attention_mask, input_ids, mask_token_id, mask_positions)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), where]

    def positions(self, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None,
                  mask_token_id: int | None = None, mask_positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """(B,) the one token of each row this pooler reads (see :meth:`select`); None when it reads every token
        (mean)."""
        B, S = attention_mask.shape
        if self.pooler == "mean":
            return None
        if self.pooler in FIRST_TOKEN_POOLERS:
            return torch.zeros(B, dtype=torch.long, device=attention_mask.device)
        if self.pooler == "last":  # the highest real position: the row's last token, whichever side it is padded on
            order = torch.arange(1, S + 1, device=attention_mask.device)
            return (attention_mask.to(torch.long) * order).argmax(1)
        # mask, topk: the template's [MASK] state
        if mask_positions is not None:
            return mask_positions
        if input_ids is None or mask_token_id is None:
            raise ValueError("pooler 'mask' needs input_ids and a tokenizer with a mask token")
        is_mask = input_ids == mask_token_id
        missing = ~is_mask.any(1)
        if missing.any():
            raise ValueError(f"pooler 'mask': {int(missing.sum())} input(s) contain no mask token; "
                             "encode with a template that contains [MASK]")
        return is_mask.to(torch.int8).argmax(1)

    def _active(self) -> bool:
        return self.head is not None and (self.mlp == "always" or self.training)

    def transform(self, vec: torch.Tensor) -> torch.Tensor:
        """The ``mlm_transform`` head, when active: applied per row to a selected vector (and to a template bias)
        before denoising; the identity for every other head."""
        return self.head(vec) if self.head_kind == "mlm_transform" and self._active() else vec

    def apply_head(self, vec: torch.Tensor) -> torch.Tensor:
        """The trainable head, when the mlp mode applies it in the current train/eval mode (the
        ``mlm_transform`` head is applied by :meth:`transform` instead)."""
        if self.head_kind == "new" and self._active():
            vec = self.head(vec)
        return vec

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor, input_ids: torch.Tensor | None = None,
                mask_token_id: int | None = None, mask_positions: torch.Tensor | None = None) -> torch.Tensor:
        vec = self.select(hidden, attention_mask, input_ids, mask_token_id, mask_positions)
        return self.apply_head(self.transform(vec))


def check_pooler_fits(pooler: str, causal: bool, model: str) -> None:
    """A causal backbone's first token sees only itself: its state says nothing about the sentence."""
    if causal and pooler in FIRST_TOKEN_POOLERS:
        raise ValueError(f"pooler {pooler!r} reads the first token, which in the causal (decoder) model {model} sees "
                         "no other token: use pooler 'last' (the last real token, what decoder embedders use) or "
                         "'mean'")


@torch.no_grad()
def init_linear_layers(module: nn.Module, std: float) -> None:
    """Hugging Face's ``_init_weights`` for the Linear layers of ``module``: weights N(0, std), biases 0."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.normal_(0.0, std)
            if m.bias is not None:
                m.bias.zero_()


def bn_mlp_head(hidden_size: int) -> nn.Sequential:
    """DiffCSE's ``ProjectionMLP`` (used by D2CSE): H -> 2H -> H, both Linear layers without bias, BatchNorm
    after each (the first with affine parameters, the last with ``affine=False``), ReLU between them."""
    return nn.Sequential(nn.Linear(hidden_size, 2 * hidden_size, bias=False), nn.BatchNorm1d(2 * hidden_size),
                         nn.ReLU(), nn.Linear(2 * hidden_size, hidden_size, bias=False),
                         nn.BatchNorm1d(hidden_size, affine=False))


def topk_token_representation(mask_hidden: torch.Tensor, mlm_head: nn.Module, word_embeddings: torch.Tensor,
                              k: int) -> torch.Tensor:
    """PromptBERT's Eq. 3: ``sum_{v in top-k} W_v p(v | h) / sum_{v in top-k} p(v | h)``.

    ``p(v | h)`` is the MLM head's softmax over the vocabulary at the [MASK] state ``h`` (B, hidden);
    ``W_v`` the static (input) embedding of token v, (vocab, hidden). Differentiable through the probabilities.
    """
    probs = mlm_head(mask_hidden).float().softmax(-1)
    top = probs.topk(k, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    return torch.einsum("bk,bkh->bh", weights, word_embeddings[top.indices].float()).to(mask_hidden.dtype)


# ------------------------------------------------------------------ the model's own pooling
#: sentence-transformers' pooling modes that a fastprompt pooler computes the same way
ST_POOLING_MODES = {"cls": "cls", "mean": "mean", "lasttoken": "last"}
#: the boolean keys older sentence-transformers versions write into the Pooling module's config.json
_ST_LEGACY_MODE_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                        "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_MAX_CONFIG_BYTES = 1 << 20  # a sentence-transformers module config is a few hundred bytes


@dataclass(frozen=True)
class NativePooling:
    """How a model's own sentence-transformers configuration pools: ``pooler`` is the fastprompt pooler that
    computes it (None when the model has no such configuration, or pools in a way no fastprompt pooler does);
    ``source`` says where it was read, or why it is not known."""

    pooler: str | None
    source: str


def native_pooling(model_name_or_path: str | os.PathLike) -> NativePooling:
    """The pooling the model was trained for, read from its sentence-transformers configuration: the Pooling
    module that ``modules.json`` names (``1_Pooling/config.json`` without one), in the model's folder, its
    installed package or, for a hub id, the local Hugging Face cache (nothing is downloaded). Never raises for
    a missing, unreadable or foreign configuration: the returned ``source`` says what was found instead."""
    from .resolve import resolve_model

    try:
        where, kind = resolve_model(model_name_or_path)
    except (OSError, ValueError) as exc:
        return NativePooling(None, f"the model cannot be found ({exc})")
    if kind == "hub":
        return _hub_native_pooling(where)
    return _folder_native_pooling(Path(where))


def _read_small_json(path: Path):
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise ValueError(f"larger than {_MAX_CONFIG_BYTES} bytes")
    return json.loads(path.read_text(encoding="utf-8"))


def _pooling_config_path(modules, folder: Path) -> Path | str:
    """The Pooling module's config.json named by ``modules.json``'s entries, or why there is none."""
    if not isinstance(modules, list):
        return "modules.json is not a list of modules"
    for entry in modules:
        if isinstance(entry, dict) and str(entry.get("type", "")).endswith("Pooling"):
            sub = PurePosixPath(str(entry.get("path", "")))
            if sub.is_absolute() or ".." in sub.parts:  # read nothing outside the model's own folder
                return f"modules.json names a Pooling module outside the model folder ({str(sub)!r})"
            return folder / sub / "config.json"
    return "modules.json names no Pooling module"


def _pooling_from_config(config, source: str) -> NativePooling:
    if not isinstance(config, dict):
        return NativePooling(None, f"{source} is not a JSON object")
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in _ST_LEGACY_MODE_KEYS.items() if config.get(key) is True]
    modes = [modes] if isinstance(modes, str) else list(modes) if isinstance(modes, (list, tuple)) else []
    if len(modes) != 1:
        what = " + ".join(map(str, modes)) or "no pooling mode"
        return NativePooling(None, f"{source} gives {what}, which no fastprompt pooler computes")
    pooler = ST_POOLING_MODES.get(modes[0])
    if pooler is None:
        return NativePooling(None, f"{source} gives {modes[0]!r} pooling, which no fastprompt pooler computes "
                                   f"(they compute {', '.join(ST_POOLING_MODES)})")
    return NativePooling(pooler, source)


def _folder_native_pooling(folder: Path) -> NativePooling:
    modules = folder / "modules.json"
    try:
        config_path = (_pooling_config_path(_read_small_json(modules), folder) if modules.is_file()
                       else folder / "1_Pooling" / "config.json")
        if isinstance(config_path, str):
            return NativePooling(None, f"{config_path} ({folder})")
        if not config_path.is_file():
            return NativePooling(None, f"no sentence-transformers pooling configuration in {folder} "
                                       f"({config_path.relative_to(folder)} does not exist)")
        return _pooling_from_config(_read_small_json(config_path), str(config_path))
    except (OSError, ValueError) as exc:  # unreadable, not UTF-8, not JSON, too large
        return NativePooling(None, f"the sentence-transformers configuration in {folder} cannot be read ({exc})")


def _hub_native_pooling(model_id: str) -> NativePooling:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return NativePooling(None, f"{model_id} is a hub id and huggingface_hub is not installed")

    def cached(name: str) -> Path | None:
        found = try_to_load_from_cache(model_id, name)
        return Path(found) if isinstance(found, str) else None

    modules = cached("modules.json")
    if modules is None:
        return NativePooling(None, f"no sentence-transformers configuration of {model_id} in the local "
                                   "Hugging Face cache (modules.json)")
    try:
        config_path = _pooling_config_path(_read_small_json(modules), modules.parent)
        if isinstance(config_path, str):
            return NativePooling(None, f"{config_path} ({model_id})")
        found = cached(config_path.relative_to(modules.parent).as_posix())
        if found is None:
            return NativePooling(None, f"{model_id}: {config_path.relative_to(modules.parent)} is not in the "
                                       "local Hugging Face cache")
        return _pooling_from_config(_read_small_json(found), f"{model_id}/{config_path.relative_to(modules.parent)}")
    except (OSError, ValueError) as exc:
        return NativePooling(None, f"the sentence-transformers configuration of {model_id} cannot be read ({exc})")

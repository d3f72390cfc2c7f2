"""How each family numbers positions, and what that means for inputs: BERT, ELECTRA, DistilBERT and the decoders
count from 0; the RoBERTa family and MPNet start after the padding index (``padding_idx + 1``), which their
embeddings compute with ``create_position_ids_from_input_ids`` (:func:`padding_offset` reads that from the loaded
model, so a family that copies RoBERTa's embeddings, such as CamemBERT, is numbered the same way). fastprompt's
explicit position ids (packed batches, soft input tokens, a [CLS] prompt, a "shifted" prefix) follow it
(:func:`position_ids`), the longest input is the position table less that offset (:func:`max_input_length`), and
BERT weights under a RoBERTa-family ``model_type`` are refused when they load (:func:`check_position_offset`).
"""
from __future__ import annotations

import sys

import torch


def padding_offset(model) -> int | None:
    """The padding index of a model whose position ids start after it (``padding_idx + 1``: the RoBERTa family,
    MPNet), None for one whose positions start at 0. Such embeddings number positions with
    ``create_position_ids_from_input_ids``, a method (RoBERTa) or a function of their module (MPNet)."""
    emb = getattr(model, "embeddings", None)
    pad = getattr(emb, "padding_idx", None)
    if not isinstance(pad, int):
        return None
    module = sys.modules.get(type(emb).__module__)
    numbered = hasattr(emb, "create_position_ids_from_input_ids") or \
        hasattr(module, "create_position_ids_from_input_ids")
    return pad if numbered else None


def offset_position_ids(input_ids: torch.Tensor, pad: int, shift: int = 0) -> torch.Tensor:
    """Position ids of a :func:`padding_offset` model: ``pad + 1 + shift`` onwards at the tokens, ``pad`` at the
    padding (transformers' ``create_position_ids_from_input_ids`` with ``past_key_values_length=shift``)."""
    mask = input_ids.ne(pad).long()
    return (mask.cumsum(1) + shift) * mask + pad


def check_position_offset(model, where: str) -> None:
    """Refuse BERT weights under a RoBERTa-family ``model_type`` (positions silently shifted by one or two).

    Models whose position ids start after the padding index (RoBERTa, XLM-R, MPNet: ``padding_idx + 1``) keep
    the position-embedding row of ``padding_idx`` at zero: it is an ``nn.Embedding`` padding row, which
    transformers initialises to zero and which never gets a gradient. Weights trained with positions from 0
    (BERT) use that row for a real position, so it is not zero. The key names cannot tell: BertModel and
    RobertaModel save the same ones."""
    table = getattr(getattr(model, "embeddings", None), "position_embeddings", None)
    pad = padding_offset(model)
    if pad is None or table is None or not 0 <= pad < table.weight.shape[0]:
        return
    if bool(table.weight[pad].detach().ne(0).any()):  # host read: once, when the model loads
        model_type = getattr(model.config, "model_type", "?")
        raise ValueError(f"the config.json of {where} says model_type {model_type!r}, whose position ids start "
                         f"after the padding index {pad}, but the weights use position row {pad} (a {model_type} "
                         "model never trains it): they come from a model whose positions start at 0, such as BERT; "
                         "set model_type (and the architecture) in config.json to the model the weights belong to")


def max_input_length(model, shifted_by: int = 0) -> int | None:
    """The most tokens one input may have: the learned position embeddings minus the positions they start at
    (RoBERTa's start after the padding index) and minus ``shifted_by`` (a prompt that moves token positions).
    None when the model has no such table."""
    n = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(n, int):
        return None
    pad = padding_offset(model)
    start = 0 if pad is None else pad + 1
    return n - start - shifted_by


def check_max_length(max_length: int | None, limit: int | None, model: str | None, *, shifted: int = 0,
                     soft_tokens: int = 0) -> None:
    """ValueError when inputs of ``max_length`` tokens would not fit ``limit`` (:func:`max_input_length`, of a
    backbone whose positions a "shifted" prefix moves by ``shifted`` and ``soft_tokens`` input tokens take)."""
    if max_length is None:
        return
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive integer, got {max_length!r}")
    if limit is not None and max_length > limit:
        why = ""
        if shifted:
            why += f" minus the {shifted} prompt positions of position_mode='shifted'"
        if soft_tokens:
            why += f" minus the {soft_tokens} soft input tokens"
        raise ValueError(f"max_length {max_length} is more tokens than {model!r} can take: at most "
                         f"{limit} (its position embeddings{why})")


def position_ids(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 positions: torch.Tensor | None = None, *, shift: int = 0, soft=None,
                 explicit: bool = False) -> torch.Tensor | None:
    """Explicit position ids where transformers' defaults would be wrong for us, else None.

    ``positions``: (B, S) positions of the tokens counted from the first (0 for [CLS]); the backbone's own
    offset (RoBERTa's ``padding_idx + 1``) and ``shift`` (a "shifted" prefix) are added here. ``soft``: the
    :class:`~fastprompt.model.soft_prompt.InputPrompt` whose tokens the sequence gains; ``explicit``: ids
    are needed even without these (a [CLS] prompt or the cache path feeds the backbone other inputs).
    """
    if not (shift > 0 or explicit or positions is not None or soft is not None):
        return None
    pad = padding_offset(model)
    if positions is None and soft is None:
        if pad is not None:  # RoBERTa family, MPNet: offsets by padding_idx
            return offset_position_ids(input_ids, pad, shift)
        S = input_ids.shape[1]
        return (torch.arange(S, device=input_ids.device) + shift).unsqueeze(0).expand(input_ids.shape[0], -1)
    if positions is None:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
    if soft is not None:
        positions, attention_mask = soft.insert_positions(positions), soft.insert_mask(attention_mask)
    if pad is not None:
        return torch.where(attention_mask.bool(), positions + pad + 1 + shift, pad)
    return positions + shift

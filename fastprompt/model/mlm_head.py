"""The backbone's masked-language-model head, read from its checkpoint (the ``topk`` pooler, the MLM term, the
``mlm_transform`` pooler head).

:class:`PromptEncoder` loads the backbone with ``AutoModel``, which drops the MLM head; this reads just the head's
tensors (``cls.predictions.*`` for BERT, ``lm_head.*`` for RoBERTa, from ``model.safetensors`` or a sharded
safetensors index) into the head module of the matching ``AutoModelForMaskedLM`` class, built on the meta
device so the rest of that model costs nothing. The decoder shares the backbone's word embeddings, as in BERT
and RoBERTa, unless the checkpoint stores its own. A pre-training checkpoint (``BertForPreTraining``, the layout
of bert-base-uncased) also keeps the next-sentence head under ``cls.seq_relationship.*``: those tensors are
skipped by name (:data:`OTHER_HEADS`); any other unknown tensor under the head's prefix is an error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from fastprompt.io import read_json
from fastprompt.messages import shown
from fastprompt.remote_code import refusing_remote_code

HEAD_ATTRIBUTES = ("cls", "lm_head")  # BertForMaskedLM.cls, RobertaForMaskedLM.lm_head
# heads that share the MLM head's prefix in a checkpoint but are not part of it: BertForPreTraining's
# next-sentence classifier (cls.seq_relationship.weight / .bias)
OTHER_HEADS = ("seq_relationship.",)
NO_HEAD_HINT = ("the topk pooler needs a checkpoint saved from a *ForMaskedLM model (e.g. bert-base-uncased, "
                "roberta-base), or choose another pooler (mask, cls, mean)")


@dataclass
class ShardIndex:
    """The schema of ``model.safetensors.index.json`` (:mod:`fastprompt.schema`): tensor name -> shard file."""

    weight_map: dict[str, str]


def _safetensors_files(path: Path, hint: str = NO_HEAD_HINT) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = set(read_json(index, "shard index", schema=ShardIndex)["weight_map"].values())
        outside = sorted(f for f in shards if Path(f).name != f or f in (".", ".."))
        if outside:  # a shard is a file of the folder: never a path that reads elsewhere
            raise ValueError(f"shard index {index} names files outside its folder: {shown(outside)}")
        return sorted(path / f for f in shards)
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors in {path}: the MLM head is only read from safetensors; " + hint)


def load_mlm_head(model_path: str | os.PathLike, backbone: nn.Module, hint: str = NO_HEAD_HINT,
                  trust_remote_code: bool = False) -> nn.Module:
    """The frozen MLM head of the checkpoint at ``model_path``, on the backbone's device and dtype.

    ``head(hidden) -> logits`` over the vocabulary. A clear ``ValueError`` when the checkpoint has no head
    (``hint``: what the caller's user can do about it). ``trust_remote_code``: as the backbone was loaded.
    """
    from transformers import AutoModelForMaskedLM

    path = Path(model_path)
    try:
        with torch.device("meta"), refusing_remote_code(path, trust_remote_code):
            mlm = AutoModelForMaskedLM.from_config(backbone.config, trust_remote_code=trust_remote_code)
    except ValueError as exc:
        raise ValueError(f"{backbone.config.model_type} has no masked-LM class in transformers: {exc}; "
                         + hint) from exc
    name = next((a for a in HEAD_ATTRIBUTES if isinstance(getattr(mlm, a, None), nn.Module)), None)
    if name is None:
        raise ValueError(f"{type(mlm).__name__} keeps its MLM head under none of {HEAD_ATTRIBUTES}; " + hint)
    head = getattr(mlm, name)
    prefix = name + "."
    tensors = {}
    for file in _safetensors_files(path, hint):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k[len(prefix):]: f.get_tensor(k) for k in f.keys()
                            if k.startswith(prefix) and not k[len(prefix):].startswith(OTHER_HEADS)})
    if not tensors:
        raise ValueError(f"{path} holds no MLM head weights ({prefix}*): {hint}")
    emb = backbone.get_input_embeddings().weight
    head.to_empty(device=emb.device)
    decoder = head.get_output_embeddings() if hasattr(head, "get_output_embeddings") else None
    decoder = decoder or getattr(head, "predictions", head).decoder
    missing, unexpected = head.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.endswith("decoder.weight") and not k.endswith("decoder.bias")]
    if missing or unexpected:
        raise ValueError(f"MLM head weights in {path} do not match {type(mlm).__name__}: missing {missing}, "
                         f"unexpected {unexpected}")
    if not any(k.endswith("decoder.weight") for k in tensors):
        decoder.weight = emb  # tied to the word embeddings, as the pretrained model is
    # BERT and RoBERTa share the decoder's bias with the head's ``bias``; to_empty gave each its own storage
    owner = next(m for m in head.modules() if getattr(m, "decoder", None) is decoder)
    if isinstance(getattr(owner, "bias", None), nn.Parameter) and not any(k.endswith("decoder.bias") for k in tensors):
        decoder.bias = owner.bias
    return head.to(emb.dtype).requires_grad_(False).eval()


def load_mlm_transform(model_path: str | os.PathLike, backbone: nn.Module,
                       trust_remote_code: bool = False) -> nn.Module:
    """The checkpoint's pretrained MLM transform (BERT's ``cls.predictions.transform``: dense, activation,
    LayerNorm), trainable: PromptBERT's supervised head (``--mask_embedding_sentence_org_mlp``)."""
    hint = ("pooler_head: mlm_transform needs a checkpoint saved from a BERT-family *ForMaskedLM model (e.g. "
            "bert-base-uncased), whose MLM head holds a transform; use pooler_head: new otherwise")
    head = load_mlm_head(model_path, backbone, hint=hint, trust_remote_code=trust_remote_code)
    transform = getattr(getattr(head, "predictions", None), "transform", None)
    if not isinstance(transform, nn.Module):
        raise ValueError(f"the MLM head of {model_path} ({type(head).__name__}) has no separate transform; " + hint)
    return transform.requires_grad_(True).train()


def load_pooler_heads(model_name_or_path: str | os.PathLike, backbone: nn.Module, pooler: str, pooler_head: str,
                      trust_remote_code: bool = False) -> tuple[nn.Module | None, nn.Module | None]:
    """``(mlm_head, mlm_transform)`` of a :class:`~fastprompt.model.PromptEncoder`, each None where not asked for:
    the base model's MLM head for pooler ``topk`` (a saved fine-tuned backbone has none; tied to this backbone's
    embeddings) and its pretrained transform for ``pooler_head="mlm_transform"`` (a checkpoint's trained one
    replaces it when the checkpoint loads)."""
    from .resolve import resolve_model_path

    mlm_head = mlm_transform = None
    if pooler == "topk":
        mlm_head = load_mlm_head(resolve_model_path(model_name_or_path), backbone, trust_remote_code=trust_remote_code)
    if pooler_head == "mlm_transform":
        mlm_transform = load_mlm_transform(resolve_model_path(model_name_or_path), backbone,
                                           trust_remote_code=trust_remote_code)
    return mlm_head, mlm_transform


def trainable_mlm_head(head: nn.Module) -> nn.Module:
    """A checkpoint's head (from :func:`load_mlm_head`) made trainable as DCPCSE's code trains it.

    DCPCSE/PromCSE build ``lm_head = RobertaLMHead(config)`` (``BertLMPredictionHead`` for BERT) next to the
    frozen encoder; ``from_pretrained`` fills it from the checkpoint (for RoBERTa; BERT's ``lm_head.*`` names
    match no ``cls.predictions.*`` tensor, so there it starts from init_weights()), nothing freezes it, and
    their model defines no ``get_output_embeddings``, so its decoder is not tied to the word embeddings: every
    tensor of the head, the decoder's (vocab, hidden) matrix included, trains at the prompt's learning rate.
    Here: the decoder's weight becomes its own copy of what it holds (the word embeddings, or the
    checkpoint's own decoder), the output bias lives in the decoder only (one tensor, saved once), and every
    parameter requires a gradient.
    """
    decoder = head.get_output_embeddings() if hasattr(head, "get_output_embeddings") else None
    decoder = decoder or getattr(head, "predictions", head).decoder
    decoder.weight = nn.Parameter(decoder.weight.detach().clone())
    owner = next(m for m in head.modules() if getattr(m, "decoder", None) is decoder)
    if isinstance(getattr(owner, "bias", None), nn.Parameter):
        if decoder.bias is owner.bias:
            owner.bias = None
        else:
            raise ValueError(f"{type(head).__name__} keeps an output bias apart from its decoder's: not a head "
                             "this function knows how to train")
    return head.requires_grad_(True).train()


def new_tied_mlm_head(backbone: nn.Module, trust_remote_code: bool = False) -> nn.Module:
    """A freshly initialised MLM head of the backbone's family, its decoder tied to the (frozen) word embeddings.

    For backbones saved without a head (sentence-transformers' all-MiniLM-L6-v2 keeps only ``BertModel``). The
    transform (dense, activation, LayerNorm) and the output bias are new and trainable (normal(0,
    initializer_range) weights, zero biases, unit LayerNorm, as Hugging Face initialises them); the decoder's
    weight is the backbone's word embeddings and stays frozen. Not a pretrained head: training it is a
    deviation from DCPCSE, which reuses the checkpoint's.
    """
    from transformers import AutoModelForMaskedLM

    config = backbone.config
    with torch.device("meta"):
        mlm = AutoModelForMaskedLM.from_config(config, trust_remote_code=trust_remote_code)
    name = next((a for a in HEAD_ATTRIBUTES if isinstance(getattr(mlm, a, None), nn.Module)), None)
    if name is None:
        raise ValueError(f"{type(mlm).__name__} keeps its MLM head under none of {HEAD_ATTRIBUTES}")
    head = getattr(mlm, name)
    emb = backbone.get_input_embeddings().weight
    head.to_empty(device=emb.device)
    std = getattr(config, "initializer_range", 0.02)
    decoder = getattr(head, "predictions", head).decoder
    for module in head.modules():
        if isinstance(module, nn.Linear) and module is not decoder:
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    # the output bias lives in the decoder; the head's own ``bias`` (the tying slot of a checkpoint's head) is
    # dropped so that no tensor is saved twice in the resume state
    owner = next(m for m in head.modules() if getattr(m, "decoder", None) is decoder)
    owner.bias = None
    nn.init.zeros_(decoder.bias)
    head = head.to(emb.dtype)
    decoder.weight = emb  # tied and frozen: part of the backbone
    return head

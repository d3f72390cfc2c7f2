"""Every closed set of choices fastprompt accepts, in one place.

Standard library only, so the command line can offer these as ``choices=`` for ``--help`` without
importing torch, and the configuration can reject a typo before any model or data is loaded. Every other
module (ops, model, config, CLI) imports its allowed values from here instead of spelling them out.

Which backend a fused op runs is decided by one rule, :func:`fastprompt.backends.resolve_backend` (a layer above
this one: it reads :data:`BACKENDS` from here).
"""
from __future__ import annotations

from collections.abc import Iterable

from fastprompt import _moved
from fastprompt.messages import shown

#: Implementations of the fused ops (``contrastive_loss``, ``prefix_attention``); the rule that picks one:
#: :func:`fastprompt.backends.resolve_backend`.
BACKENDS = ("auto", "triton", "cpu", "reference")
#: The contrastive loss's backends: those of every fused op, and "chunked" (its cuBLAS products with a Triton epilogue).
LOSS_BACKENDS = BACKENDS + ("chunked",)
#: How the last hidden states become one sentence vector ("last": the last real token, decoder embedders' pooling).
POOLERS = ("cls", "cls_before_pooler", "mean", "mask", "topk", "bn_mlp", "last")
#: The poolers that read the first token ([CLS]): meaningless on a causal (decoder) model.
FIRST_TOKEN_POOLERS = ("cls", "cls_before_pooler", "bn_mlp")
#: The poolers that read a template's [MASK] position: with them a sentence is always wrapped in a template
#: (PromptBERT's by default).
TEMPLATE_POOLERS = ("mask", "topk")
#: The ``--pooler_type`` values of PromCSE/DCPCSE's own code that work with their prompts (``fastprompt import``):
#: their avg, avg_top2 and avg_first_last poolers multiply the S token states by the (P + S)-long
#: prompt-extended mask and fail, so no checkpoint used them.
PAPER_POOLER_TYPES = ("cls", "cls_before_pooler")
#: When the pooler's trainable head is applied.
MLP_MODES = ("none", "train", "always")
#: What the pooler's trainable head is: a new one, SimCSE's Linear + Tanh (DiffCSE's BatchNorm MLP with pooler
#: bn_mlp), or the checkpoint's pretrained MLM transform applied before template denoising (PromptBERT's
#: supervised BERT).
POOLER_HEADS = ("new", "mlm_transform")
#: How the prefix reaches attention: the fused op, or the DynamicCache reference path.
PREFIX_MODES = ("attention", "cache")
#: Kinds of trainable prompt: per-layer prefix key/values, soft input tokens, both, or none (LoRA or full
#: fine-tuning alone: ``lora`` or ``train_backbone`` must then train something).
PROMPT_TYPES = ("prefix", "input", "both", "none")
#: Initialisation of a new prompt.
INIT_MODES = ("normal", "uniform", "vocab")
#: Token position ids: standard (0..S-1) or shifted by the prompt length (the papers' transformers 4.2.1 code).
POSITION_MODES = ("standard", "shifted")
#: Device types a training run takes (``cuda:N`` names one GPU); checked by fastprompt.model.device.
TRAIN_DEVICE_TYPES = ("auto", "cpu", "cuda")
#: Training precision (autocast dtype).
PRECISIONS = ("fp32", "bf16", "fp16")
#: Where the MLM term's head comes from: the backbone's checkpoint, or a new head tied to the word embeddings.
MLM_HEADS = ("checkpoint", "tied_new")
#: The replaced-token-detection term (D2CSE): its discriminator (the backbone with the shared prompts, or
#: without prompts), its conditional input, and how a masked-LM generator picks a replacement.
RTD_DISCRIMINATORS = ("prompted", "plain")
RTD_CONDITIONS = ("after_head", "before_head", "none")
RTD_SAMPLING = ("sample", "argmax")
#: What the replaced-token-detection loss sum is divided by: its target tokens (the real tokens but position 0),
#: or every position of the padded batch (the count DiffCSE's CrossEntropyLoss averages over).
RTD_AVERAGES = ("tokens", "positions")
#: The denominator of SKICSE's Eq. 6 (L_ski2, anchor h, positive h^ski): as printed (the entailments and the
#: contradictions), or the SKIs (Eq. 2's form, which makes it a -log softmax of its positive).
SKI2_DENOMINATORS = ("printed", "ski")
#: Reductions of the contrastive loss over anchors.
REDUCTIONS = ("mean", "sum", "none")
#: Hardness weighting of the contrastive loss's negative logits (sentence-transformers' ``hardness_mode``): which
#: negatives get ``hardness_strength * stop_grad(cos)`` added.
HARDNESS_MODES = ("in_batch_negatives", "hard_negatives", "all_negatives")
#: How the symmetric contrastive loss normalises its two directions: a softmax each, averaged, or one joint softmax.
PARTITION_MODES = ("per_direction", "joint")
#: GISTEmbed's false-negative threshold below the positive's score: ``pos - margin`` or ``pos - |pos| * margin``.
MARGIN_STRATEGIES = ("absolute", "relative")
#: Training-file formats: a text corpus, pairs/triplets (or query/positive/negative columns) with a header, comma- or
#: tab-separated, or query/pos/neg JSON lines (FlagEmbedding's).
TRAIN_FORMATS = ("auto", "text", "csv", "tsv", "jsonl")
#: How several training datasets (``train_files``) share a run's batches (fastprompt.data.multi).
DATASET_SAMPLING = ("round_robin", "proportional")
#: What to do with lines of a text corpus that are not UTF-8.
DECODE_ERROR_MODES = ("error", "skip")
#: Weights dtype names accepted on the command line.
DTYPES = ("float32", "float16", "bfloat16")
#: Where SKI generation runs its LLM: in-process (Hugging Face) or an OpenAI-compatible server.
LLM_BACKENDS = ("local", "server")
#: Endpoints of an OpenAI-compatible server: chat completions (instruction models) or plain completions.
SERVER_APIS = ("chat", "completions")


def check_choice(name: str, value, allowed: Iterable[str]) -> None:
    """Raise ``ValueError`` naming ``name``, the bad ``value`` and every allowed value."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {shown(value)}")


#: resolve_backend and its two errors, which this module re-exported before they moved to fastprompt.backends
__getattr__ = _moved.module_getattr(__name__)

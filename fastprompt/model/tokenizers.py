"""Checks of a model folder's tokenizer that fail at load, naming the folder, instead of on the first unknown word
deep inside a run; the padding token decoder tokenizers lack."""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def check_tokenizer(tokenizer, where: str) -> None:
    """Refuse a WordPiece tokenizer whose unknown token is not in its vocabulary: it raises
    ``WordPiece error: Missing [UNK] token`` (a bare ``Exception``) on the first word it does not know, in the middle
    of encoding or training."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if model is None or type(model).__name__ != "WordPiece":
        return
    unk = getattr(model, "unk_token", None)
    vocab = backend.get_vocab()
    if unk is None or unk not in vocab:
        raise ValueError(f"the tokenizer of {where} has no unknown token in its vocabulary (its WordPiece model names "
                         f"{unk!r}, which is not among its {len(vocab)} tokens): it cannot encode a word it does not "
                         "know; add that token to its vocab.txt / tokenizer.json, or use the model's own tokenizer "
                         "files")


def ensure_pad_token(tokenizer) -> None:
    """Decoder tokenizers (Llama, Mistral) often have no padding token; the padded positions are masked, so any id
    serves: EOS, as sentence-transformers and transformers' examples do."""
    if getattr(tokenizer, "pad_token_id", 0) is None and getattr(tokenizer, "eos_token", None) is not None:
        logger.info("the tokenizer has no padding token: padding with its EOS token %r", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token

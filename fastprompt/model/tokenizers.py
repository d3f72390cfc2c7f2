"""Checks of a model folder's tokenizer that fail at load, naming the folder, instead of on the first unknown word
deep inside a run."""
from __future__ import annotations


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

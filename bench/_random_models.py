"""Random-weight encoders of real models' shapes, written to a folder at run time: what the GPU kit and the benches
train on a machine without the models (nothing downloaded, nothing large carried). Timings depend on the shapes,
not on the weights' values.

A BERT of a named shape (:data:`SHAPES`) gets a tokenizer: a given folder's (e.g. all-MiniLM-L6-v2's, which has
BERT's vocabulary), or else a synthetic WordPiece vocabulary of BERT's size holding the benches' generated words.
"""
from __future__ import annotations

from pathlib import Path

#: BERT-family shapes: the tiny test model, all-MiniLM-L6-v2 and bert-base.
SHAPES = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}
#: The words of the benches' generated sentences (bench_train_step.sentences) and a few more.
WORDS = ("the a man woman dog cat plays runs eats sits on in with guitar park table water red big small two people "
         "one street car ball food blue music").split()
BERT_VOCAB_SIZE = 30522


def synthetic_tokenizer(folder: Path):
    """A WordPiece tokenizer with BERT's special tokens and vocabulary size, knowing :data:`WORDS`."""
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + WORDS + [".", ",", "?"]
    vocab += [f"tok{i}" for i in range(BERT_VOCAB_SIZE - len(vocab))]
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    tokenizer.model_max_length = 512
    tokenizer.save_pretrained(folder)
    return tokenizer


def random_bert(folder: str | Path, shape: str = "minilm", tokenizer: str | Path | None = None) -> Path:
    """Write a BERT of ``shape`` (:data:`SHAPES`) with random weights (seed 0) and a tokenizer to ``folder``."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {sorted(SHAPES)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tok = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
        tok.save_pretrained(folder)
    else:
        tok = synthetic_tokenizer(folder)
    config = BertConfig(vocab_size=len(tok), max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                        **SHAPES[shape])
    torch.manual_seed(0)
    BertModel(config).save_pretrained(folder)
    return folder

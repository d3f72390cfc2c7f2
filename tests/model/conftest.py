"""Tiny random masked-LM backbones for the PromptBERT tests (built at test time, no downloads).

``tiny_bert_mlm_dir``: a BertForMaskedLM (``cls.predictions.*``) with a WordPiece tokenizer.
``tiny_roberta_bpe_dir``: a RobertaForMaskedLM (``lm_head.*``) with a real byte-level BPE tokenizer trained on
a few sentences, so RoBERTa's leading-space tokenisation ("Ġdog") and ``<mask>`` (lstrip) are exercised.
"""
from pathlib import Path

import pytest

WORDS = ("the a an is are was of to and in on with for at by from it this that man woman dog cat plays play "
         "playing runs run eating eats food guitar ball park street car red blue big small sentence means two "
         "people one sits sitting table water").split()
CORPUS = [" ".join(WORDS[i:i + 7]) + " ." for i in range(len(WORDS))] + [
    'This sentence : "a man plays a guitar ." means something .', "The sentence : ' it ' means .",
    "This sentence of \" the dog \" means that ."]


def _config(cls, vocab_size, **extra):
    return cls(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=96, hidden_dropout_prob=0.1,
               attention_probs_dropout_prob=0.1, **extra)


@pytest.fixture(scope="session")
def tiny_bert_mlm_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    path = tmp_path_factory.mktemp("tiny-bert-mlm")
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'\":;-()")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + chars + ["##" + c for c in chars]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    tok.model_max_length = 64
    tok.save_pretrained(path)
    torch.manual_seed(1)
    BertForMaskedLM(_config(BertConfig, len(vocab), pad_token_id=0)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_roberta_bpe_dir(tmp_path_factory) -> Path:
    import torch
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizerFast

    path = tmp_path_factory.mktemp("tiny-roberta-bpe")
    bpe = ByteLevelBPETokenizer()
    # <mask> absorbs the space before it (lstrip), as in roberta-base's tokenizer.json
    bpe.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=[
        "<s>", "<pad>", "</s>", "<unk>", AddedToken("<mask>", lstrip=True, special=True)])
    bpe._tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                               cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    tok.model_max_length = 64
    tok.save_pretrained(path)
    torch.manual_seed(2)
    config = _config(RobertaConfig, len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    RobertaForMaskedLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mpnet_dir() -> Path:
    """The real all-mpnet-base-v2, assembled offline by ``bash ../shared/models/fetch-mpnet.sh`` (into
    $FASTPROMPT_MODELS or ~/.cache/fastprompt-models)."""
    import os

    root = Path(os.environ.get("FASTPROMPT_MODELS") or Path.home() / ".cache" / "fastprompt-models")
    path = root / "all-mpnet-base-v2"
    if not (path / ".complete").is_file():
        pytest.skip(f"all-mpnet-base-v2 is not at {path}: assemble it with bash ../shared/models/fetch-mpnet.sh")
    return path


@pytest.fixture
def two_threads():
    """The real models' tests run on two threads, whatever the suite set before."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)

"""Corpora readers, tokenisation/collation and batch samplers (text -> token ids).

- :func:`load_train_file` — a text corpus (one sentence per line) or a ``sent0,sent1[,hard_neg]`` CSV
- :func:`builtin_wiki_corpus` — the default corpus embedded in the gensim wheel (``builtin:gensim-wiki``)
- :class:`Collator` / :class:`Batch` — dynamic padding, all views of a batch in one tensor
- :class:`UniqueBatchSampler` — seeded, resumable, no duplicate sentence inside a batch
"""
from fastprompt.data.builtin import builtin_wiki_corpus, write_builtin_corpus
from fastprompt.data.collate import Batch, Collator, hf_tokenize
from fastprompt.data.corpus import (
    BUILTIN_WIKI,
    TrainExamples,
    load_train_file,
    read_pair_csv,
    read_text_corpus,
)
from fastprompt.data.sampler import UniqueBatchSampler, sentence_keys

__all__ = [
    "BUILTIN_WIKI",
    "Batch",
    "Collator",
    "TrainExamples",
    "UniqueBatchSampler",
    "builtin_wiki_corpus",
    "hf_tokenize",
    "load_train_file",
    "read_pair_csv",
    "read_text_corpus",
    "sentence_keys",
    "write_builtin_corpus",
]

"""Corpora readers, tokenisation/collation, batch samplers (text -> token ids).

- :func:`load_train_file` — a training file of any layout, by its extension and first line (``train_files.py``): a
  text corpus (one sentence per line), a ``sent0,sent1[,hard_neg]`` CSV (``corpus.py``), query / positives /
  negatives rows (``retrieval.py``), a SKI file
- :func:`builtin_wiki_corpus` — the default corpus embedded in the gensim wheel (``builtin:gensim-wiki``)
- :class:`Collator` / :class:`Batch` — dynamic padding, all views of a batch in one tensor
- :class:`UniqueBatchSampler` — seeded, resumable, no duplicate sentence inside a batch
- :mod:`fastprompt.data.ski` — SKICSE's training files: :func:`read_ski_csv` and :func:`join_ski` (their
  generation, ``fastprompt generate-ski``, is the method's: :mod:`fastprompt.methods.skicse.generation`)

Imported lazily, so that ``import fastprompt.data`` loads no torch; ``fastprompt generate-ski`` and ``join-ski`` are
:mod:`fastprompt.methods.skicse.commands`.
"""
from typing import TYPE_CHECKING

from fastprompt._lazy import lazy_getattr

if TYPE_CHECKING:  # the definitions, for type checkers and IDEs; at run time a name loads on first use
    from fastprompt.data.builtin import builtin_wiki_corpus as builtin_wiki_corpus
    from fastprompt.data.builtin import write_builtin_corpus as write_builtin_corpus
    from fastprompt.data.collate import Batch as Batch
    from fastprompt.data.collate import Collator as Collator
    from fastprompt.data.collate import hf_tokenize as hf_tokenize
    from fastprompt.data.corpus import BUILTIN_WIKI as BUILTIN_WIKI
    from fastprompt.data.corpus import TrainExamples as TrainExamples
    from fastprompt.data.corpus import read_pair_csv as read_pair_csv
    from fastprompt.data.corpus import read_text_corpus as read_text_corpus
    from fastprompt.data.sampler import UniqueBatchSampler as UniqueBatchSampler
    from fastprompt.data.sampler import sentence_keys as sentence_keys
    from fastprompt.data.ski.files import SKI_COLUMNS as SKI_COLUMNS
    from fastprompt.data.ski.files import SKI_TRIPLET_COLUMNS as SKI_TRIPLET_COLUMNS
    from fastprompt.data.ski.files import join_ski as join_ski
    from fastprompt.data.ski.files import read_ski_csv as read_ski_csv
    from fastprompt.data.train_files import load_train_file as load_train_file

_LAZY = {
    "BUILTIN_WIKI": "fastprompt.data.corpus",
    "TrainExamples": "fastprompt.data.corpus",
    "load_train_file": "fastprompt.data.train_files",
    "read_pair_csv": "fastprompt.data.corpus",
    "read_text_corpus": "fastprompt.data.corpus",
    "builtin_wiki_corpus": "fastprompt.data.builtin",
    "write_builtin_corpus": "fastprompt.data.builtin",
    "Batch": "fastprompt.data.collate",
    "Collator": "fastprompt.data.collate",
    "hf_tokenize": "fastprompt.data.collate",
    "UniqueBatchSampler": "fastprompt.data.sampler",
    "sentence_keys": "fastprompt.data.sampler",
    "SKI_COLUMNS": "fastprompt.data.ski.files",
    "SKI_TRIPLET_COLUMNS": "fastprompt.data.ski.files",
    "read_ski_csv": "fastprompt.data.ski.files",
    "join_ski": "fastprompt.data.ski.files",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)

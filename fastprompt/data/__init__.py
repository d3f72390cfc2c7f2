"""Corpora readers, tokenisation/collation, batch samplers (text -> token ids), and SKI generation.

- :func:`load_train_file` — a text corpus (one sentence per line) or a ``sent0,sent1[,hard_neg]`` CSV
- :func:`builtin_wiki_corpus` — the default corpus embedded in the gensim wheel (``builtin:gensim-wiki``)
- :class:`Collator` / :class:`Batch` — dynamic padding, all views of a batch in one tensor
- :class:`UniqueBatchSampler` — seeded, resumable, no duplicate sentence inside a batch
- :mod:`fastprompt.data.ski` — SKICSE's LLM-generated "sentence knowable information": generation
  (``fastprompt generate-ski``), :func:`read_ski_csv` and :func:`join_ski`

Imported lazily, so that ``fastprompt -h`` (which registers ``fastprompt.data.ski.cli``) loads no torch.
"""
from fastprompt._lazy import lazy_getattr

_LAZY = {
    "BUILTIN_WIKI": "fastprompt.data.corpus",
    "TrainExamples": "fastprompt.data.corpus",
    "load_train_file": "fastprompt.data.corpus",
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

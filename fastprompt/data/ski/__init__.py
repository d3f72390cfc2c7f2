"""SKICSE's training files: a sentence and its "sentence knowable information" (SKI), what an LLM says it knows
about it. Reading them is data's job; generating them is the SKICSE method's
(:mod:`fastprompt.methods.skicse.generation`, ``fastprompt generate-ski``).

- :func:`read_ski_csv` — a ``sent0,ski`` file (what ``generate-ski`` writes) as training data
- :func:`join_ski` — NLI triplets with the SKI of each premise appended (``sent0,sent1,hard_neg,ski``, also written
  by ``fastprompt join-ski``); :func:`write_examples_csv` writes them
- :func:`read_input_sentences` — the distinct sentences of a file, the input of a generation run

Standard library only.
"""
from fastprompt import _moved
from fastprompt.data.ski.files import (
    SKI_COLUMNS,
    SKI_TRIPLET_COLUMNS,
    join_ski,
    meta_path,
    read_input_sentences,
    read_ski_csv,
    write_examples_csv,
)

__all__ = [
    "SKI_COLUMNS",
    "SKI_TRIPLET_COLUMNS",
    "join_ski",
    "meta_path",
    "read_input_sentences",
    "read_ski_csv",
    "write_examples_csv",
]


# names that moved away from here keep importing, with a warning (fastprompt._moved)
__getattr__ = _moved.module_getattr(__name__)

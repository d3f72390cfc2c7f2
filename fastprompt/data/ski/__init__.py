"""SKICSE's "sentence knowable information" (SKI): what an LLM says it knows about each training sentence.

Generation (``fastprompt generate-ski``, or in Python)::

    from fastprompt.data.ski import LocalBackend, generate_ski
    report = generate_ski(sentences, LocalBackend(), "ski.csv")       # SmolLM2-135M-Instruct, offline
    report = generate_ski(sentences, ServerBackend("http://127.0.0.1:8000/v1", "meta-llama/Llama-2-7b-chat-hf"),
                          "ski.csv")

- :func:`generate_ski` — resumable generation into a ``sent0,ski`` CSV (+ rejected rows and metadata)
- :class:`LocalBackend` / :class:`ServerBackend` — a Hugging Face causal LM in-process / an OpenAI-compatible server
- :data:`SKI_PROMPT_TEMPLATE`, :class:`Sampling`, :class:`AnswerFilter` — what is asked, how, and what is kept
- :func:`read_ski_csv`, :func:`join_ski` — the files as training data (``sent0,ski``; ``sent0,sent1,hard_neg,ski``,
  also written by ``fastprompt join-ski``)

Standard library only at import time: torch and transformers load when a :class:`LocalBackend` is created.
"""
from fastprompt.data.ski.files import (
    SKI_COLUMNS,
    SKI_TRIPLET_COLUMNS,
    join_ski,
    read_input_sentences,
    read_ski_csv,
    write_examples_csv,
)
from fastprompt.data.ski.filters import REJECT_REASONS, AnswerFilter, Generation, clean_answer, echo_ratio
from fastprompt.data.ski.generate import Backend, GenerationReport, generate_ski
from fastprompt.data.ski.local import DEFAULT_LOCAL_MODEL, LocalBackend
from fastprompt.data.ski.prompt import SKI_PROMPT_TEMPLATE, Sampling
from fastprompt.data.ski.server import LLMServerError, ServerBackend

__all__ = [
    "DEFAULT_LOCAL_MODEL",
    "REJECT_REASONS",
    "SKI_COLUMNS",
    "SKI_PROMPT_TEMPLATE",
    "SKI_TRIPLET_COLUMNS",
    "AnswerFilter",
    "Backend",
    "Generation",
    "GenerationReport",
    "LLMServerError",
    "LocalBackend",
    "Sampling",
    "ServerBackend",
    "clean_answer",
    "echo_ratio",
    "generate_ski",
    "join_ski",
    "read_input_sentences",
    "read_ski_csv",
    "write_examples_csv",
]

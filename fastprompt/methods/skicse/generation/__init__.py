"""SKICSE's data preparation: ask an LLM what it knows about each training sentence (its "sentence knowable
information", SKI), into the ``sent0,ski`` file that :func:`fastprompt.data.ski.read_ski_csv` reads.

Generation (``fastprompt generate-ski``, or in Python)::

    from fastprompt.methods.skicse.generation import LocalBackend, generate_ski
    report = generate_ski(sentences, LocalBackend(), "ski.csv")       # SmolLM2-135M-Instruct, offline
    report = generate_ski(sentences, ServerBackend("http://127.0.0.1:8000/v1", "meta-llama/Llama-2-7b-chat-hf"),
                          "ski.csv")

- :func:`generate_ski` — resumable generation into a ``sent0,ski`` CSV (+ rejected rows and metadata; ``store.py``)
- :class:`LocalBackend` / :class:`ServerBackend` — a Hugging Face causal LM in-process / an OpenAI-compatible server
- :data:`SKI_PROMPT_TEMPLATE`, :class:`Sampling`, :class:`AnswerFilter` — what is asked, how, and what is kept

Standard library only at import time: torch and transformers load when a :class:`LocalBackend` is created.
"""
from fastprompt.methods.skicse.generation.filters import (
    REJECT_REASONS,
    AnswerFilter,
    Generation,
    clean_answer,
    echo_ratio,
)
from fastprompt.methods.skicse.generation.generate import Backend, GenerationReport, generate_ski
from fastprompt.methods.skicse.generation.local import LocalBackend
from fastprompt.methods.skicse.generation.prompt import SKI_PROMPT_TEMPLATE, Sampling
from fastprompt.methods.skicse.generation.server import LLMServerError, ServerBackend
from fastprompt.model.gguf import DEFAULT_LOCAL_MODEL

__all__ = [
    "DEFAULT_LOCAL_MODEL",
    "REJECT_REASONS",
    "SKI_PROMPT_TEMPLATE",
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
]

"""Which LLM answers become SKI: empty, over-long and echo answers are rejected, with the reason counted.

- ``empty``: no letter or digit left after whitespace is collapsed.
- ``too_long``: the model had not finished when it reached the token budget (``max_new_tokens``; a server's
  ``finish_reason == "length"``). The prompt asks for at most four sentences, about 100 tokens, so the
  default budget of 160 tokens is generous; a cut answer ends mid-sentence.
- ``echo``: the answer mostly repeats the sentence: at least ``echo_threshold`` (0.8) of the answer's
  words (lower-cased ``\\w+`` runs, counted with repetition) occur in the sentence. A verbatim copy scores
  1.0; an answer that adds knowledge brings new words and scores lower.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import NamedTuple

_WORD = re.compile(r"\w+")
_SPACE = re.compile(r"\s+")

#: Rejection reasons, in the order they are checked.
REJECT_REASONS = ("empty", "too_long", "echo")


class Generation(NamedTuple):
    """One answer of a backend: its text, whether the model stopped by itself, and the tokens it generated
    (``None`` when the server does not report usage)."""

    text: str
    finished: bool
    tokens: int | None = None


def clean_answer(text: str) -> str:
    """Whitespace collapsed to single spaces (newlines included): one SKI is one CSV line and one encoder input."""
    return _SPACE.sub(" ", text).strip()


def echo_ratio(sentence: str, answer: str) -> float:
    """Fraction of the answer's words (with repetition) that occur in the sentence; 0.0 for an answer without words."""
    words = _WORD.findall(answer.lower())
    if not words:
        return 0.0
    vocab = set(_WORD.findall(sentence.lower()))
    return sum(w in vocab for w in words) / len(words)


@dataclass(frozen=True)
class AnswerFilter:
    echo_threshold: float = 0.8

    def __post_init__(self):
        if not 0 < self.echo_threshold <= 1:
            raise ValueError(f"echo_threshold must be in (0, 1], got {self.echo_threshold}")

    def reject_reason(self, sentence: str, answer: Generation) -> str | None:
        """The first of :data:`REJECT_REASONS` that applies to the (cleaned) answer, or None to keep it."""
        text = clean_answer(answer.text)
        if not _WORD.search(text):
            return "empty"
        if not answer.finished:
            return "too_long"
        if echo_ratio(sentence, text) >= self.echo_threshold:
            return "echo"
        return None

    def to_dict(self) -> dict:
        return asdict(self)

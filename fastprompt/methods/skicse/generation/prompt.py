"""The SKICSE prompt: what the LLM is asked about each sentence, and the seeds of its samples.

The two numbered instructions are the SKICSE paper's wording. How the sentence is placed before them
(``Sentence: "..."`` on its own line) is this package's choice; ``--prompt-template`` replaces the whole
text. The backend then wraps it in the model's chat template (local models that have one, and a server's
chat endpoint), or sends it as it is (plain completions).
"""
from __future__ import annotations

import hashlib
import string
from dataclasses import asdict, dataclass

#: The default template; ``{sentence}`` is replaced by the sentence.
SKI_PROMPT_TEMPLATE = (
    'Sentence: "{sentence}"\n'
    "1) Answer objectively what you know about the sentence. "
    "2) Make sure your answers are no more than four sentences and contain important information."
)


def check_template(template: str) -> str:
    """``template`` if it has exactly the one field ``{sentence}`` (literal braces doubled), else ValueError."""
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"prompt template is not a valid format string ({exc}); write literal braces as "
                         "{{ }}") from None
    if fields != ["sentence"]:
        raise ValueError(f"prompt template must contain the field {{sentence}} exactly once (and no other field); "
                         f"found {fields or 'no field'}")
    return template


def format_prompt(template: str, sentence: str) -> str:
    return template.format(sentence=sentence)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings shared by both backends. ``temperature == 0`` is greedy decoding.

    Defaults: the generation defaults of LLaMA-2-chat (the paper's model family): temperature 0.6, top-p
    0.9. 160 new tokens leave room for the four sentences the prompt allows (about 100 tokens).
    """

    max_new_tokens: int = 160
    temperature: float = 0.6
    top_p: float = 0.9
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return asdict(self)


def sample_seed(seed: int, attempt: int, text: str) -> int:
    """A 31-bit seed for one sample, a function of the run's seed, the attempt number and the text only.

    Independent of batching and order, so a server that honours per-request seeds (vLLM), and the local
    backend (one generator per sentence), give every sentence the same answer however the run was split,
    resumed or parallelised.
    """
    digest = hashlib.sha256(f"{seed}\0{attempt}\0{text}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


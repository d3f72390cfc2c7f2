"""Generate SKI for a list of sentences with a backend, resumably: :func:`generate_ski`.

A backend (:class:`~.local.LocalBackend`, :class:`~.server.ServerBackend`)
turns prompts into :class:`~.filters.Generation` objects; this module builds the prompts,
filters the answers, re-samples rejected ones, writes rows as they arrive and records what was done.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol

from fastprompt.methods.skicse.generation.filters import AnswerFilter, Generation, clean_answer
from fastprompt.methods.skicse.generation.prompt import (
    SKI_PROMPT_TEMPLATE,
    Sampling,
    check_template,
    format_prompt,
    sample_seed,
)
from fastprompt.methods.skicse.generation.store import SkiStore

logger = logging.getLogger(__name__)


class Backend(Protocol):
    """What :func:`generate_ski` needs from an LLM backend."""

    name: str

    def settings(self) -> dict:
        """What decides the answers besides the prompt and sampling (model, chat template use, endpoint kind);
        recorded in the metadata and compared when a run resumes."""

    def info(self) -> dict:
        """Descriptive details recorded in the metadata only (files, device, URL)."""

    def render(self, prompt: str) -> str:
        """The text the model sees for ``prompt`` (chat template applied), for the metadata's example."""

    def generate(self, prompts: Sequence[str], sampling: Sampling,
                 seeds: Sequence[int]) -> Iterator[tuple[int, Generation]]:
        """Answer every prompt; yield ``(index, generation)`` as answers complete, in any order."""


@dataclass
class GenerationReport:
    """What a :func:`generate_ski` call did. ``rows``/``rejected`` count the whole output file (all runs);
    the rest counts this call."""

    output: str
    rows: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    sentences: int = 0
    already_done: int = 0
    duplicates: int = 0
    accepted_now: int = 0
    rejected_now: dict[str, int] = field(default_factory=dict)
    rejected_attempts: dict[str, int] = field(default_factory=dict)
    answers: int = 0
    tokens: int = 0
    seconds: float = 0.0
    complete: bool = False

    @property
    def sentences_per_s(self) -> float:
        return (self.accepted_now + sum(self.rejected_now.values())) / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        def reasons(counts):
            return ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "none"

        done_now = self.accepted_now + sum(self.rejected_now.values())
        return (f"{self.output}: {self.rows} rows ({self.accepted_now} new); rejected sentences: "
                f"{reasons(self.rejected)} (new: {reasons(self.rejected_now)}); rejected answers this run: "
                f"{reasons(self.rejected_attempts)}; {self.already_done} of {self.sentences} distinct input sentences "
                f"were already done ({self.duplicates} repeats in the input); {done_now} sentences, {self.answers} "
                f"answers, {self.tokens} tokens in {self.seconds:.1f} s ({self.sentences_per_s:.2f} sentences/s, "
                f"{self.tokens_per_s:.1f} tokens/s)")


def unique_sentences(sentences: Iterable[str]) -> tuple[list[str], int]:
    """Stripped, non-empty sentences in first-seen order without repeats, and the number of repeats dropped."""
    seen: dict[str, None] = {}
    n = 0
    for s in sentences:
        s = s.strip()
        if not s:
            continue
        if "\n" in s:
            raise ValueError(f"a sentence cannot contain a line break: {s[:60]!r}")
        n += 1
        seen.setdefault(s, None)
    return list(seen), n - len(seen)


def generate_ski(sentences: Iterable[str], backend: Backend, output: str | os.PathLike, *,
                 template: str = SKI_PROMPT_TEMPLATE, sampling: Sampling = Sampling(),
                 answer_filter: AnswerFilter = AnswerFilter(), attempts: int = 5, limit: int | None = None,
                 overwrite: bool = False, show_progress_bar: bool | None = None,
                 input_name: str | None = None) -> GenerationReport:
    """Write the SKI of every distinct sentence to ``output`` (``sent0,ski`` CSV), skipping those done before.

    Each sentence is asked with ``template``; an answer the ``answer_filter`` rejects is sampled again with a
    new seed, up to ``attempts`` answers per sentence (one when decoding is greedy: it would repeat itself);
    a sentence whose last answer is rejected goes to ``output.rejected.csv`` with the reason. ``limit`` keeps
    the first N distinct sentences. Rows are appended as they complete, so an interrupted call loses at most
    the answers in flight, and calling again with the same settings resumes (other settings are refused
    unless ``overwrite``, which starts the output afresh). ``show_progress_bar=None``: a bar on a terminal.
    """
    from tqdm.auto import tqdm

    from fastprompt._version import __version__

    template = check_template(template)
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    unique, duplicates = unique_sentences(sentences)
    if limit is not None:
        unique = unique[:limit]
    if not unique:
        raise ValueError("no sentences to generate SKI for")
    settings = {**backend.settings(), "prompt_template": template, "sampling": sampling.to_dict(),
                "filter": answer_filter.to_dict(), "attempts": attempts}
    info = {"fastprompt_version": __version__, **backend.info(),
            "prompt_example": backend.render(format_prompt(template, unique[0]))}
    max_attempts = 1 if sampling.greedy else attempts
    report = GenerationReport(output=str(output), sentences=len(unique), duplicates=duplicates)
    rejected_now, rejected_attempts = Counter(), Counter()
    started, t0 = datetime.now(timezone.utc), time.perf_counter()
    with SkiStore(output).open(settings, info, overwrite=overwrite) as store:
        todo = [s for s in unique if s not in store.done]
        report.already_done = len(unique) - len(todo)
        logger.info("%s: %d sentences to generate (%d already done)", output, len(todo), report.already_done)
        bar = tqdm(total=len(todo), unit="sent", desc="generate-ski", dynamic_ncols=True,
                   disable=None if show_progress_bar is None else not show_progress_bar)
        try:
            for attempt in range(max_attempts):
                if not todo:
                    break
                prompts = [format_prompt(template, s) for s in todo]
                seeds = [sample_seed(sampling.seed, attempt, s) for s in todo]
                again = []
                for i, gen in backend.generate(prompts, sampling, seeds):
                    sentence = todo[i]
                    report.answers += 1
                    report.tokens += gen.tokens or 0
                    reason = answer_filter.reject_reason(sentence, gen)
                    if reason is None:
                        store.accept(sentence, clean_answer(gen.text))
                        report.accepted_now += 1
                    else:
                        rejected_attempts[reason] += 1
                        if attempt + 1 < max_attempts:
                            again.append(i)
                            continue
                        store.reject(sentence, clean_answer(gen.text), reason)
                        rejected_now[reason] += 1
                    bar.update(1)
                    bar.set_postfix(kept=report.accepted_now, rejected=sum(rejected_now.values()), refresh=False)
                todo = [todo[i] for i in sorted(again)]
            report.complete = True
        finally:
            bar.close()
            report.seconds = time.perf_counter() - t0
            report.rejected_now, report.rejected_attempts = dict(rejected_now), dict(rejected_attempts)
            counts = store.counts()
            report.rows, report.rejected = counts["rows"], counts["rejected"]
            store.finish({
                "started": started.isoformat(timespec="seconds"), "seconds": round(report.seconds, 3),
                "input": input_name, "sentences": report.sentences, "already_done": report.already_done,
                "accepted": report.accepted_now, "rejected": report.rejected_now,
                "answers": report.answers, "rejected_answers": report.rejected_attempts, "tokens": report.tokens,
                "sentences_per_s": round(report.sentences_per_s, 4), "tokens_per_s": round(report.tokens_per_s, 2),
                "complete": report.complete,
            }, complete=report.complete)
    logger.info("%s", report.summary())
    return report

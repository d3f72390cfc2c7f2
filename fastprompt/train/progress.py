"""Progress: the training bar's text, and long evaluations in the log for runs whose stderr is not a terminal
(tqdm's bar is off there).

The final seven-task STS evaluation encodes ~25k sentences: minutes on a CPU with no sign of life in a log
file or a batch job's output. :class:`LoggedEncoder` wraps a model's ``encode`` and logs how far it got.
"""
from __future__ import annotations

import logging
import math
import time

import numpy as np

logger = logging.getLogger(__name__)


def bar_postfix(loss: float | None, dev: float | None) -> str:
    """The training bar's postfix: ``loss=0.1234 dev=81.20`` (what is known)."""
    parts = []
    if loss is not None:
        parts.append(f"loss={loss:.4f}")
    if dev is not None:
        parts.append(f"dev={dev:.2f}")
    return " ".join(parts)


class LoggedEncoder:
    """``encode`` in about ``reports`` chunks, logging ``what: encoded i/n sentences`` after each.

    The sentences are taken in the :class:`~fastprompt.model.PromptEncoder`'s ``encoding_order`` (the order its
    ``encode`` batches them in) and cut into whole batches, so every batch is the one a single ``encode`` call would
    form: the vectors are the same.
    """

    def __init__(self, model, what: str, reports: int = 10):
        self.model, self.what, self.reports = model, what, reports

    def encode(self, sentences, batch_size: int = 64, show_progress_bar=None, **kwargs) -> np.ndarray:
        n = len(sentences)
        order = self.model.encoding_order(sentences, kwargs.get("max_length"))
        chunk = batch_size * max(1, math.ceil(n / batch_size / self.reports))
        out, start_time = None, time.perf_counter()
        for start in range(0, n, chunk):
            idx = order[start:start + chunk]
            emb = np.asarray(self.model.encode([sentences[i] for i in idx], batch_size=batch_size,
                                               show_progress_bar=False, **kwargs))
            if out is None:
                out = np.empty((n, emb.shape[1]), dtype=emb.dtype)
            out[idx] = emb
            logger.info("%s: encoded %d/%d sentences (%.0f s)", self.what, min(start + chunk, n), n,
                        time.perf_counter() - start_time)
        return out

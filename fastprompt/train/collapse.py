"""Representation collapse: every sentence mapped to (nearly) the same direction.

A far too high learning rate can drive the prompt to a point where the encoder's output no longer depends
on its input: with ``learning_rate=1e6`` on MiniLM the gradient norm falls to ~1e-7 within three steps and,
dropout off, all sentences get the same vector. The loss stays finite and nothing else stops the run.

In training mode dropout still makes the vectors differ, so the step's own statistics cannot tell. At every
train_log.csv row the trainer embeds a fixed probe of distinct training sentences as a user would (eval mode,
no gradient) and logs their ``emb_spread``::

    emb_spread = mean_i |u_i - mean_j u_j|^2 = 1 - |mean_j u_j|^2,   u_i = z_i / |z_i|

the mean squared distance of the unit vectors to their centroid: about 1 - 1/n for directions spread over
the sphere, 0 when every sentence has the same direction. How spread a *healthy* encoder is depends on the
encoder (all-MiniLM-L6-v2, cls pooling: 0.24 on 64 wiki sentences; the tiny random test BERT, cls: 3e-6), so
a check is collapsed when the spread falls below ``collapse_ratio`` (default 1e-2) times the spread of the
same probe before the first step. Measured (``docs/troubleshooting.md, "Training runs"``): MiniLM at
``learning_rate=1e6`` goes 0.24 -> 0.0; the tiny BERT 3e-6 -> 1e-32 (cls) and 0.064 -> 3.6e-4 (mean), while
at ``learning_rate=1e-2`` its spread moves by less than 3%. :class:`CollapseMonitor` warns at the first
collapsed check and asks the trainer to stop after ``collapse_patience`` of them in a row.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

#: The train_log.csv column (and step statistic) holding the spread.
SPREAD_STAT = "emb_spread"


@torch.no_grad()
def embedding_spread(z: torch.Tensor) -> float:
    """``1 - |mean of the rows' unit vectors|^2`` of ``z`` (rows, dim), in [0, 1); 0: every row one direction."""
    # mean |u_i - centroid|^2 in float64 (equal to 1 - |centroid|^2, without its cancellation): exactly 0 for
    # identical rows, and resolved far below float32 rounding for nearly identical ones.
    u = torch.nn.functional.normalize(z.detach().double(), dim=-1)
    return float((u - u.mean(0)).square().sum(-1).mean())


class CollapseMonitor:
    """Counts consecutive collapsed checks; warns at the first one of a streak and says when to stop.

    Args:
        ratio: a check whose ``emb_spread`` is below ``ratio * start`` is collapsed (0 disables the check).
        patience: consecutive collapsed checks after which :meth:`update` returns True (0: warn only).
        start: the probe's spread before training (None: the check is off until :attr:`start` is set).
    """

    def __init__(self, ratio: float, patience: int, start: float | None = None):
        self.ratio, self.patience, self.start = ratio, patience, start
        self.streak = 0

    @property
    def threshold(self) -> float:
        return self.ratio * self.start if self.start is not None else 0.0

    def update(self, step: int, spread: float | None) -> bool:
        """Record the probe's spread after ``step``; True when the run should stop."""
        if not self.threshold or spread is None:  # also off when the base model itself has no spread
            return False
        if spread >= self.threshold:
            if self.streak:
                logger.info("step %d: embeddings spread again (emb_spread %.3g) after %d collapsed checks", step,
                            spread, self.streak)
            self.streak = 0
            return False
        self.streak += 1
        if self.streak == 1:
            logger.warning("step %d: representation collapse: every sentence has nearly the same embedding "
                           "(emb_spread %.2g, %.2g before training); the learning rate is probably too high%s",
                           step, spread, self.start,
                           f" (stopping after {self.patience} such checks in a row)" if self.patience else "")
        return bool(self.patience) and self.streak >= self.patience

    def message(self, step: int) -> str:
        return (f"stopped at step {step}: representation collapse in {self.streak} consecutive checks (every "
                f"sentence embedded in nearly the same direction: emb_spread < {self.ratio:g} x its {self.start:.2g} "
                "before training); lower "
                "learning_rate (or set collapse_patience=0 to only warn). last/ holds the collapsed prompt; "
                "best/ the best one evaluated before it")

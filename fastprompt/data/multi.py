"""Several training datasets in one run: each batch from one dataset, datasets interleaved round-robin or in
proportion to their sizes (sentence-transformers' ``MultiDatasetBatchSamplers``).

:class:`MultiDatasetSampler` wraps one :class:`~fastprompt.data.sampler.UniqueBatchSampler` per dataset (each with
its own seed stream, so a dataset's batches do not depend on the others) and interleaves their epoch plans:

- ``round_robin``: dataset 0, 1, ..., D-1, 0, 1, ... until the dataset with the fewest batches has given all of
  its batches (the others' remaining batches of that epoch are not trained: every dataset weighs the same);
- ``proportional``: every batch of every dataset once per epoch, in a seeded random order of dataset labels, so a
  dataset is drawn in proportion to its number of batches.

An epoch's plan is a pure function of ``(seed, epoch)``, like the single sampler's, so the trainer's data position
``(epoch, batch_in_epoch)`` in ``last/`` is the whole sampler state: a resumed run continues with the same batch
from the same dataset. One dataset is the plain single-dataset plan (either mode).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from fastprompt.choices import DATASET_SAMPLING, check_choice
from fastprompt.data.sampler import UniqueBatchSampler


class MultiDatasetSampler:
    """Yields ``(batch_index, (dataset_index, rows))``; see the module docstring."""

    def __init__(self, samplers: Sequence[UniqueBatchSampler], *, mode: str = "round_robin", seed: int = 0):
        check_choice("dataset_sampling", mode, DATASET_SAMPLING)
        if not samplers:
            raise ValueError("need at least one dataset")
        self.samplers = list(samplers)
        self.mode = mode
        self.seed = int(seed)
        self._cache: dict[int, list[tuple[int, int]]] = {}

    def plan(self, epoch: int) -> list[tuple[int, int]]:
        """``(dataset, batch of that dataset's epoch)`` for every step of ``epoch`` (the latest epoch's is cached)."""
        if epoch not in self._cache:
            counts = [s.num_batches(epoch) for s in self.samplers]
            if self.mode == "round_robin" or len(counts) == 1:
                n = min(counts)
                labels = [d for _ in range(n) for d in range(len(counts))]
            else:
                labels = np.repeat(np.arange(len(counts)), counts)
                labels = np.random.default_rng([self.seed, int(epoch), len(counts)]).permutation(labels).tolist()
            taken = [0] * len(counts)
            plan = []
            for d in labels:
                plan.append((d, taken[d]))
                taken[d] += 1
            self._cache = {epoch: plan}
        return self._cache[epoch]

    def num_batches(self, epoch: int) -> int:
        return len(self.plan(epoch))

    def iter_from(self, epoch: int, start: int = 0) -> Iterator[tuple[int, tuple[int, list[int]]]]:
        """Yields ``(batch_index, (dataset, rows))`` of ``epoch`` starting at ``start`` (for resuming)."""
        plan = self.plan(epoch)
        for b in range(start, len(plan)):
            d, i = plan[b]
            yield b, (d, self.samplers[d].epoch_batches(epoch)[i])

    def __len__(self) -> int:
        return self.num_batches(0)

"""A seeded, resumable batch sampler that never puts the same sentence twice into one batch.

Contrastive losses treat every other sentence in the batch as a negative; a duplicate would be a false
negative (and, for identical positives, a tie in the softmax). The sampler shuffles the rows with a
generator seeded by ``(seed, epoch)`` and fills batches greedily; a row whose sentence (in any column)
is already in the current batch is deferred to the next batch that can take it. The plan of an epoch is a
pure function of ``(rows, batch_size, seed, epoch)``, so resuming at ``(epoch, batch_index)`` only needs
those two integers.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def sentence_keys(rows: Sequence[tuple[str, ...]]) -> list[tuple[int, ...]]:
    """Map every distinct sentence to an integer id; returns the ids of each row (duplicates within a row removed).
    A padding negative (:data:`~fastprompt.data.retrieval.PAD_TEXT`) is no sentence: it has no id."""
    from fastprompt.data.retrieval import PAD_TEXT

    ids: dict[str, int] = {}
    out = []
    for row in rows:
        out.append(tuple(dict.fromkeys(ids.setdefault(s, len(ids)) for s in row if s != PAD_TEXT)))
    return out


class UniqueBatchSampler:
    """Yields lists of row indices; no sentence occurs twice in a batch.

    Args:
        keys: per row, the integer ids of its sentences (see :func:`sentence_keys`).
        batch_size: rows per batch (>= 2: in-batch negatives need at least two rows).
        seed: shuffling seed; epoch ``e`` uses ``numpy.random.default_rng([seed, e])``.
        shuffle: if False, rows keep file order (duplicates are still deferred).
        drop_last: drop the final batch of an epoch when it is smaller than ``batch_size``.
    A trailing batch of a single row is always dropped (it has no negative).
    """

    def __init__(self, keys: Sequence[tuple[int, ...]], batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = False):
        if batch_size < 2:
            raise ValueError(
                f"batch_size must be >= 2 for in-batch negatives (got {batch_size}): with one row per batch the "
                "contrastive loss has no negative to contrast against"
            )
        if len(keys) < 2:
            raise ValueError(f"need at least 2 training rows for in-batch negatives, got {len(keys)}")
        self.keys = list(keys)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._cache: dict[int, list[list[int]]] = {}

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.keys))
        return np.random.default_rng([self.seed, int(epoch)]).permutation(len(self.keys))

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The full batch plan of ``epoch`` (deterministic; the latest epoch's plan is cached)."""
        if epoch not in self._cache:
            self._cache = {epoch: self._plan(self.order(epoch))}
        return self._cache[epoch]

    def _plan(self, order: np.ndarray) -> list[list[int]]:
        keys, bs = self.keys, self.batch_size
        batches: list[list[int]] = []
        deferred: deque[int] = deque()
        cur: list[int] = []
        seen: set[int] = set()

        def try_add(i: int) -> bool:
            if any(k in seen for k in keys[i]):
                return False
            cur.append(i)
            seen.update(keys[i])
            return True

        def fill_from_deferred() -> None:
            for _ in range(len(deferred)):
                if len(cur) == bs:
                    break
                j = deferred.popleft()
                if not try_add(j):
                    deferred.append(j)

        def emit() -> None:
            nonlocal cur
            batches.append(cur)
            cur = []
            seen.clear()
            fill_from_deferred()  # a new batch first takes the rows that earlier batches had to defer

        for i in order.tolist():
            if not try_add(i):
                deferred.append(i)
            while len(cur) == bs:
                emit()
        while cur or deferred:
            if not cur:  # only conflicting leftovers: the first always fits an empty batch
                try_add(deferred.popleft())
                fill_from_deferred()
            emit()
        n_dropped = 0
        while batches and (len(batches[-1]) < 2 or (self.drop_last and len(batches[-1]) < bs)):
            n_dropped += len(batches.pop())
        if n_dropped:
            logger.debug("sampler: dropped %d trailing row(s) of an epoch", n_dropped)
        return batches

    def num_batches(self, epoch: int) -> int:
        return len(self.epoch_batches(epoch))

    def iter_from(self, epoch: int, start: int = 0) -> Iterator[tuple[int, list[int]]]:
        """Yields ``(batch_index, rows)`` of ``epoch`` starting at ``start`` (for resuming)."""
        batches = self.epoch_batches(epoch)
        for b in range(start, len(batches)):
            yield b, batches[b]

    def __iter__(self) -> Iterator[list[int]]:
        for _, batch in self.iter_from(0):
            yield batch

    def __len__(self) -> int:
        return self.num_batches(0)

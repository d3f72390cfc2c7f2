"""UniqueBatchSampler: seeded, resumable, and no duplicate sentence inside a batch."""
import random

import pytest

from fastprompt.data import UniqueBatchSampler, sentence_keys


def _rows(n, n_distinct):
    rng = random.Random(0)
    return [(f"s{rng.randrange(n_distinct)}", f"p{i}", f"n{rng.randrange(n_distinct)}") for i in range(n)]


@pytest.mark.parametrize("n,bs,distinct", [(103, 8, 40), (50, 7, 500), (20, 16, 3)])
def test_batches_have_no_duplicate_sentences_and_cover_each_row_once(n, bs, distinct):
    rows = _rows(n, distinct)
    keys = sentence_keys(rows)
    s = UniqueBatchSampler(keys, bs, seed=3)
    batches = s.epoch_batches(0)
    seen_rows = []
    for b in batches:
        assert 2 <= len(b) <= bs
        sents = [x for i in b for x in keys[i]]
        assert len(sents) == len(set(sents)), "duplicate sentence in a batch"
        seen_rows += b
    # every row at most once; only trailing single-row batches may be dropped
    assert len(seen_rows) == len(set(seen_rows))
    assert n - len(seen_rows) <= 1 or distinct == 3


def test_premise_shared_across_columns_counts_as_duplicate():
    rows = [("a", "b"), ("b", "c"), ("d", "e"), ("f", "a")]
    s = UniqueBatchSampler(sentence_keys(rows), 4, seed=0, shuffle=False)
    for b in s.epoch_batches(0):
        words = [w for i in b for w in rows[i]]
        assert len(words) == len(set(words))


def test_seeded_reproducible_and_epochs_differ():
    keys = sentence_keys([(f"x{i}",) for i in range(64)])
    a = UniqueBatchSampler(keys, 8, seed=1)
    b = UniqueBatchSampler(keys, 8, seed=1)
    c = UniqueBatchSampler(keys, 8, seed=2)
    assert a.epoch_batches(0) == b.epoch_batches(0)
    assert a.epoch_batches(0) != c.epoch_batches(0)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    assert sorted(i for bt in a.epoch_batches(1) for i in bt) == list(range(64))


def test_resume_from_position_yields_the_rest():
    keys = sentence_keys([(f"x{i}",) for i in range(30)])
    s = UniqueBatchSampler(keys, 4, seed=5)
    full = list(s.iter_from(0))
    resumed = list(UniqueBatchSampler(keys, 4, seed=5).iter_from(0, start=3))
    assert resumed == full[3:]


def test_drop_last_and_trailing_singleton():
    keys = sentence_keys([(f"x{i}",) for i in range(9)])
    assert [len(b) for b in UniqueBatchSampler(keys, 4, shuffle=False).epoch_batches(0)] == [4, 4]  # 1 left: dropped
    keys = sentence_keys([(f"x{i}",) for i in range(10)])
    assert [len(b) for b in UniqueBatchSampler(keys, 4, shuffle=False).epoch_batches(0)] == [4, 4, 2]
    assert [len(b) for b in UniqueBatchSampler(keys, 4, shuffle=False, drop_last=True).epoch_batches(0)] == [4, 4]


def test_batch_size_one_is_a_clear_error():
    with pytest.raises(ValueError, match="batch_size must be >= 2 for in-batch negatives"):
        UniqueBatchSampler(sentence_keys([("a",), ("b",)]), 1)
    with pytest.raises(ValueError, match="at least 2 training rows"):
        UniqueBatchSampler(sentence_keys([("a",)]), 2)

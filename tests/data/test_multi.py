"""MultiDatasetSampler: each batch from one dataset, round-robin or proportional, a pure function of (seed, epoch)."""
import pytest

from fastprompt.data import UniqueBatchSampler
from fastprompt.data.multi import MultiDatasetSampler


def _samplers(sizes, bs=2):
    return [UniqueBatchSampler([(d * 1000 + i,) for i in range(n)], bs, seed=d) for d, n in enumerate(sizes)]


def test_round_robin_takes_turns_until_the_smallest_is_used_up():
    sampler = MultiDatasetSampler(_samplers([6, 10, 4]), mode="round_robin")
    steps = list(sampler.iter_from(0))
    assert [d for _, (d, _) in steps] == [0, 1, 2, 0, 1, 2]  # 2 batches of the smallest
    for _, (d, rows) in steps:  # each batch holds rows of its own dataset only
        assert len(rows) == 2 and all(0 <= r < [6, 10, 4][d] for r in rows)
    assert sampler.num_batches(0) == 6


def test_proportional_draws_every_batch_once_in_a_seeded_order():
    sizes = [6, 20, 4]
    a = MultiDatasetSampler(_samplers(sizes), mode="proportional", seed=1)
    labels = [d for _, (d, _) in a.iter_from(0)]
    assert sorted(labels) == [0] * 3 + [1] * 10 + [2] * 2
    assert labels != sorted(labels)
    # every batch of every dataset once
    for d, s in enumerate(_samplers(sizes)):
        assert sorted(map(tuple, (rows for _, (dd, rows) in a.iter_from(0) if dd == d))) == \
            sorted(map(tuple, s.epoch_batches(0)))
    b = MultiDatasetSampler(_samplers(sizes), mode="proportional", seed=1)
    assert list(b.iter_from(0)) == list(a.iter_from(0))  # a pure function of (seed, epoch)
    assert [d for _, (d, _) in b.iter_from(1)] != labels  # another epoch, another order
    c = MultiDatasetSampler(_samplers(sizes), mode="proportional", seed=2)
    assert [d for _, (d, _) in c.iter_from(0)] != labels


def test_resuming_mid_epoch_continues_the_same_plan():
    sampler = MultiDatasetSampler(_samplers([8, 12]), mode="proportional", seed=3)
    whole = list(sampler.iter_from(0))
    fresh = MultiDatasetSampler(_samplers([8, 12]), mode="proportional", seed=3)
    assert list(fresh.iter_from(0, 4)) == whole[4:]


def test_one_dataset_is_the_plain_sampler():
    (single,) = _samplers([9])
    for mode in ("round_robin", "proportional"):
        multi = MultiDatasetSampler(_samplers([9]), mode=mode)
        assert [rows for _, (_, rows) in multi.iter_from(0)] == single.epoch_batches(0)


def test_bad_settings():
    with pytest.raises(ValueError, match="dataset_sampling must be one of round_robin, proportional"):
        MultiDatasetSampler(_samplers([4]), mode="random")
    with pytest.raises(ValueError, match="at least one dataset"):
        MultiDatasetSampler([])

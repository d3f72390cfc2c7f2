"""Geometry diagnostics against their textbook definitions (brute force, torch.pdist, hand-made cases)."""
import sys

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from fastprompt.eval.geometry import (
    _spearman_along,
    alignment,
    anisotropy,
    bootstrap_spearman,
    geometry_report,
    plot_cosine_density,
    retrieval_recall,
    uniformity,
)
from fastprompt.eval.sts import STSData


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_alignment_matches_wang_isola():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((13, 6)), rng.standard_normal((13, 6))
    ux, uy = torch.from_numpy(unit(x)), torch.from_numpy(unit(y))
    expected = (ux - uy).norm(dim=1).pow(2).mean().item()  # SimCSE's align_loss, alpha=2
    assert alignment(x, y) == pytest.approx(expected, rel=1e-12)
    assert alignment(x, y, alpha=1) == pytest.approx((ux - uy).norm(dim=1).mean().item(), rel=1e-12)
    assert alignment(x, 5 * x) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="equal shapes"):
        alignment(x, y[:3])


@pytest.mark.parametrize("n,block", [(2, 1), (17, 4), (17, 2048), (40, 7)])
def test_uniformity_matches_pdist(n, block):
    x = np.random.default_rng(n).standard_normal((n, 5))
    expected = torch.pdist(torch.from_numpy(unit(x)), p=2).pow(2).mul(-2).exp().mean().log().item()
    assert uniformity(x, block_size=block) == pytest.approx(expected, rel=1e-10)
    assert uniformity(x, t=0.5) == pytest.approx(
        torch.pdist(torch.from_numpy(unit(x))).pow(2).mul(-0.5).exp().mean().log().item(), rel=1e-10)


def test_anisotropy_is_the_mean_pairwise_cosine():
    x = np.random.default_rng(1).standard_normal((11, 4)) + 0.7
    u = unit(x)
    cos = u @ u.T
    expected = (cos.sum() - np.trace(cos)) / (11 * 10)
    assert anisotropy(x) == pytest.approx(expected, rel=1e-12)
    assert anisotropy(np.ones((5, 3))) == pytest.approx(1.0)
    assert anisotropy(np.array([[1.0, 0], [-1.0, 0]])) == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="zero vector"):
        anisotropy(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="at least two"):
        anisotropy(np.ones((1, 2)))


def test_retrieval_recall_hand_made():
    # three high-score pairs (queries) and one low-score pair; second sentences are the corpus,
    # with a duplicate sentence that must count once.
    data = STSData("stsb", ["q0", "q1", "q2", "low"], ["c0", "c1", "c2", "c0"], np.array([5.0, 4.2, 4.0, 1.0]))
    e2 = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    e1 = np.array([
        [0.9, 0.1, 0.0],  # q0 -> c0 first: hit@1
        [0.6, 0.5, 0.0],  # q1 -> c0 then c1: rank 2
        [0.5, 0.4, 0.3],  # q2 -> c0, c1, then c2: rank 3
        [0.0, 0.0, 1.0],
    ])
    r = retrieval_recall(e1, e2, data, ks=(1, 2, 3))
    assert r == pytest.approx({"recall@1": 100 / 3, "recall@2": 200 / 3, "recall@3": 100.0})
    assert retrieval_recall(e1, e2, data, ks=(1,), threshold=4.5) == {"recall@1": 100.0}
    with pytest.raises(ValueError, match="no pair with gold score >= 5.5"):
        retrieval_recall(e1, e2, data, threshold=5.5)
    with pytest.raises(ValueError, match="ks must be positive"):
        retrieval_recall(e1, e2, data, ks=(0,))


def test_vectorised_spearman_equals_scipy_with_ties():
    rng = np.random.default_rng(2)
    gold = rng.integers(0, 4, size=(6, 30)).astype(float)
    pred = gold + rng.standard_normal((6, 30))
    got = _spearman_along(pred, gold)
    for i in range(6):
        assert got[i] == pytest.approx(spearmanr(pred[i], gold[i]).statistic, rel=1e-12)


def test_bootstrap_interval():
    rng = np.random.default_rng(3)
    gold = rng.uniform(0, 5, 300)
    pred = gold + rng.normal(0, 1.5, 300)
    point = spearmanr(pred, gold).statistic * 100
    low, high = bootstrap_spearman(pred, gold, n_resamples=400, seed=1)
    assert low < point < high and 2 < high - low < 20
    assert bootstrap_spearman(pred, gold, n_resamples=400, seed=1) == (low, high)  # seeded
    low99, high99 = bootstrap_spearman(pred, gold, n_resamples=400, seed=1, confidence_level=0.99)
    assert low99 < low and high99 > high
    # four times the data: about half the width
    gold4 = rng.uniform(0, 5, 1200)
    pred4 = gold4 + rng.normal(0, 1.5, 1200)
    lo4, hi4 = bootstrap_spearman(pred4, gold4, n_resamples=400, seed=1)
    assert 0.3 < (hi4 - lo4) / (high - low) < 0.75
    with pytest.raises(ValueError, match="n_resamples"):
        bootstrap_spearman(pred, gold, n_resamples=1)
    with pytest.raises(ValueError, match="equal length"):
        bootstrap_spearman(pred, gold[:10])


def _toy_split(n=60, seed=4):
    rng = np.random.default_rng(seed)
    gold = rng.uniform(0, 5, n)
    base = rng.standard_normal((n, 8))
    e1 = base
    e2 = base * (gold[:, None] / 5) + rng.standard_normal((n, 8)) * (1 - gold[:, None] / 5)
    data = STSData("stsb", [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)], gold)
    return e1, e2, data


def test_geometry_report_uses_simcse_data_choice():
    e1, e2, data = _toy_split()
    rep = geometry_report(e1, e2, data)
    pos = data.scores >= 4
    assert rep["alignment"] == pytest.approx(alignment(e1[pos], e2[pos]))
    both = np.concatenate([e1, e2])
    assert rep["uniformity"] == pytest.approx(uniformity(both))
    assert rep["anisotropy"] == pytest.approx(anisotropy(both))
    assert set(rep) == {"alignment", "uniformity", "anisotropy", "recall@1", "recall@5", "recall@10"}
    assert 0 <= rep["recall@1"] <= rep["recall@5"] <= rep["recall@10"] <= 100


def test_plot_cosine_density_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    e1, e2, data = _toy_split()
    path = plot_cosine_density(e1, e2, data, tmp_path / "plots" / "density.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
    with pytest.raises(ValueError, match="must end in .png, .pdf or .svg"):
        plot_cosine_density(e1, e2, data, tmp_path / "density.jpg")


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    e1, e2, data = _toy_split()
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_cosine_density(e1, e2, data, tmp_path / "d.png")


def test_retrieval_exact_score_queries_d2cse_protocol():
    """D2CSE: queries are the pairs with gold score exactly 5, recall@1/3/5."""
    data = STSData("stsb", ["q0", "q1", "q2", "low"], ["c0", "c1", "c2", "c0"], np.array([5.0, 4.2, 5.0, 1.0]))
    e2 = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]])
    e1 = np.array([[0.9, 0.1, 0.0], [0.6, 0.5, 0.0], [0.5, 0.4, 0.3], [0.0, 0.0, 1.0]])
    # q0 rank 1, q2 rank 3; q1 (4.2) is a query only with >=
    assert retrieval_recall(e1, e2, data, ks=(1, 3, 5), threshold=5.0, exact=True) == pytest.approx(
        {"recall@1": 50.0, "recall@3": 100.0, "recall@5": 100.0})
    assert retrieval_recall(e1, e2, data, ks=(1,), threshold=4.0)["recall@1"] == pytest.approx(100 / 3)
    rep = geometry_report(e1, e2, data, ks=(1, 3), retrieval_threshold=5.0, retrieval_exact=True)
    assert rep["recall@1"] == 50.0 and set(rep) == {"alignment", "uniformity", "anisotropy", "recall@1", "recall@3"}
    with pytest.raises(ValueError, match="no pair with gold score == 4.5"):
        retrieval_recall(e1, e2, data, threshold=4.5, exact=True)

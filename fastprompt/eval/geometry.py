"""Embedding-space diagnostics the prompt-tuning papers report next to the STS table.

- :func:`alignment` / :func:`uniformity` (Wang & Isola, 2020; SimCSE's Fig. 2): expected distance^alpha
  between positive pairs, and log E exp(-t * distance^2) over all pairs, on L2-normalised vectors.
  SimCSE's choice of data: positive pairs = STS-B pairs with gold score >= 4, uniformity over all
  STS-B sentences (:func:`geometry_report`).
- :func:`anisotropy`: mean cosine similarity between different sentences (Ethayarajh, 2019), computed
  exactly over all pairs in O(N * dim) instead of sampling random pairs.
- :func:`retrieval_recall`: STS-B as retrieval. Each first sentence of a highly similar pair
  (gold >= 4) queries all distinct second sentences of the split; recall@k is the share of queries
  whose own partner ranks in the top k by cosine.
- :func:`bootstrap_spearman`: a bootstrap confidence interval of Spearman x 100 (pairs resampled
  with replacement, ``scipy.stats.bootstrap``).
- :func:`plot_cosine_density`: density of the predicted cosine similarity per gold-score group
  (SimCSE's Fig. 3 style); needs matplotlib (``pip install fastprompt[plots]``).
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy import stats

from fastprompt.io import atomic_file

from .sts import STSData, cosine_similarity_pairs


def _unit(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or len(x) == 0:
        raise ValueError(f"expected a non-empty (n, dim) array, got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if not (norms > 0).all():
        raise ValueError("zero vector among the embeddings: it has no direction")
    return x / norms


def alignment(x, y, alpha: float = 2.0) -> float:
    """E ||f(x) - f(y)||^alpha over positive pairs (rows of ``x`` and ``y``), on unit vectors. Lower is better."""
    x, y = _unit(x), _unit(y)
    if x.shape != y.shape:
        raise ValueError(f"positive pairs need equal shapes, got {x.shape} and {y.shape}")
    return float(np.mean(np.linalg.norm(x - y, axis=1) ** alpha))


def uniformity(x, t: float = 2.0, block_size: int = 2048) -> float:
    """log E_{i<j} exp(-t ||f(x_i) - f(x_j)||^2) on unit vectors (lower: more uniform on the sphere).

    Uses ||u - v||^2 = 2 - 2 u.v and goes through the Gram matrix in row blocks, so memory stays
    O(block_size * n) for any n.
    """
    u = _unit(x)
    n = len(u)
    if n < 2:
        raise ValueError("uniformity needs at least two embeddings")
    total = 0.0
    for start in range(0, n, block_size):
        gram = u[start:start + block_size] @ u.T  # (b, n)
        rows = np.arange(start, min(start + block_size, n))[:, None]
        upper = np.arange(n)[None, :] > rows  # pairs i < j only
        sq = np.clip(2.0 - 2.0 * gram, 0.0, 4.0)
        total += float(np.exp(-t * sq)[upper].sum())
    return float(np.log(total / (n * (n - 1) / 2)))


def anisotropy(x) -> float:
    """Mean cosine similarity over all pairs of different rows: (||sum u||^2 - n) / (n (n - 1))."""
    u = _unit(x)
    n = len(u)
    if n < 2:
        raise ValueError("anisotropy needs at least two embeddings")
    s = u.sum(axis=0)
    return float((s @ s - np.einsum("ij,ij->", u, u)) / (n * (n - 1)))


def retrieval_recall(e1, e2, data: STSData, ks: Sequence[int] = (1, 5, 10), threshold: float = 4.0,
                     exact: bool = False) -> dict[str, float]:
    """recall@k (x 100) of retrieving each high-score pair's second sentence among the split's second sentences.

    The queries are the pairs with gold score >= ``threshold`` (``exact``: == ``threshold``; D2CSE's protocol is
    STS-B test, score exactly 5, recall@1/3/5)."""
    e1, e2 = np.asarray(e1), np.asarray(e2)
    if len(e1) != len(data) or len(e2) != len(data):
        raise ValueError(f"{len(e1)} / {len(e2)} embeddings for {len(data)} pairs")
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"ks must be positive integers, got {list(ks)}")
    queries = np.flatnonzero(data.scores == threshold if exact else data.scores >= threshold)
    if len(queries) == 0:
        raise ValueError(f"no pair with gold score {'==' if exact else '>='} {threshold} to use as a retrieval query")
    column: dict[str, int] = {}  # one candidate per distinct second sentence
    rows = []
    for i, s in enumerate(data.sentences2):
        if s not in column:
            column[s] = len(rows)
            rows.append(i)
    target_col = np.array([column[data.sentences2[q]] for q in queries])
    sim = _unit(e1[queries]) @ _unit(e2[rows]).T  # (queries, corpus)
    own = sim[np.arange(len(queries)), target_col]
    rank = (sim > own[:, None]).sum(axis=1)  # 0 = ranked first (ties count in the query's favour)
    return {f"recall@{k}": float(np.mean(rank < k) * 100.0) for k in ks}


def _spearman_along(x, y, axis=-1):
    """Spearman's rho along ``axis`` (vectorised over resamples), average ranks for ties."""
    rx, ry = stats.rankdata(x, axis=axis), stats.rankdata(y, axis=axis)
    rx = rx - rx.mean(axis=axis, keepdims=True)
    ry = ry - ry.mean(axis=axis, keepdims=True)
    return (rx * ry).sum(axis=axis) / np.sqrt((rx * rx).sum(axis=axis) * (ry * ry).sum(axis=axis))


def bootstrap_spearman(
    predicted, gold, *, n_resamples: int = 1000, confidence_level: float = 0.95, seed: int = 0,
    method: str = "percentile",
) -> tuple[float, float]:
    """(low, high) bootstrap confidence interval of Spearman x 100, resampling pairs with replacement."""
    predicted, gold = np.asarray(predicted, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if predicted.shape != gold.shape or predicted.ndim != 1 or len(gold) < 3:
        raise ValueError(f"need two 1-D arrays of equal length >= 3, got {predicted.shape} and {gold.shape}")
    if n_resamples < 2:
        raise ValueError(f"n_resamples must be >= 2, got {n_resamples}")
    if not 0 < confidence_level < 1:
        raise ValueError(f"confidence_level must be in (0, 1), got {confidence_level}")
    rng = np.random.default_rng(seed)
    # scipy >= 1.15 takes rng=, older versions random_state=
    seed_kw = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"
    with np.errstate(invalid="ignore", divide="ignore"):  # a degenerate resample gives NaN, dropped below
        res = stats.bootstrap((predicted, gold), _spearman_along, paired=True, vectorized=True,
                              n_resamples=n_resamples, confidence_level=confidence_level, method=method,
                              batch=max(1, 2_000_000 // len(gold)), **{seed_kw: rng})
    low, high = res.confidence_interval
    if not (np.isfinite(low) and np.isfinite(high)):
        raise ValueError("bootstrap interval is undefined (too few distinct pairs)")
    return float(low) * 100.0, float(high) * 100.0


def geometry_report(e1, e2, data: STSData, *, threshold: float = 4.0, ks: Sequence[int] = (1, 5, 10),
                    retrieval_threshold: float | None = None, retrieval_exact: bool = False) -> dict[str, float]:
    """SimCSE's alignment/uniformity data choice on one STS split, plus anisotropy and retrieval recall@k.

    alignment: pairs with gold >= ``threshold``; uniformity and anisotropy: every distinct sentence; retrieval
    (:func:`retrieval_recall`): queries with gold >= ``retrieval_threshold`` (== with ``retrieval_exact``;
    None: ``threshold``), recall at each of ``ks``.
    """
    pos = data.scores >= threshold
    if not pos.any():
        raise ValueError(f"no pair with gold score >= {threshold} for alignment")
    index: dict[str, np.ndarray] = {}
    for s, e in zip(data.sentences1 + data.sentences2, np.concatenate([e1, e2])):
        index.setdefault(s, e)
    unique = np.stack(list(index.values()))
    report = {
        "alignment": alignment(e1[pos], e2[pos]),
        "uniformity": uniformity(unique),
        "anisotropy": anisotropy(unique),
    }
    rt = threshold if retrieval_threshold is None else retrieval_threshold
    report.update(retrieval_recall(e1, e2, data, ks=ks, threshold=rt, exact=retrieval_exact))
    return report


def plot_cosine_density(
    e1, e2, data: STSData, path: str | Path, *, edges: Sequence[float] = (0, 1, 2, 3, 4, 5), title: str | None = None,
) -> Path:
    """Histogram densities of the pairs' cosine similarity, one curve per gold-score group; saved to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("the cosine-similarity plot needs matplotlib: pip install matplotlib "
                          "(or fastprompt[plots])") from None
    path = Path(path)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"plot file must end in .png, .pdf or .svg, got {path.name!r}")
    cos = cosine_similarity_pairs(e1, e2)
    gold = data.scores
    fig, ax = plt.subplots(figsize=(6, 4))
    bins = np.linspace(min(-0.2, cos.min()), 1.0, 41)
    for lo, hi in zip(edges[:-1], edges[1:]):
        last = hi == edges[-1]
        sel = (gold >= lo) & ((gold <= hi) if last else (gold < hi))
        if sel.any():
            ax.hist(cos[sel], bins=bins, density=True, histtype="step", linewidth=1.5,
                    label=f"gold {lo}-{hi} (n={int(sel.sum())})")
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.set_title(title or f"{data.name}: cosine similarity by gold score")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_file(path, "plot") as tmp:  # the temporary keeps the suffix: savefig's format
            fig.savefig(tmp)
    finally:
        plt.close(fig)
    return path

"""The embedding-training options of fastprompt.ops.contrastive_loss: k negatives per anchor, hardness weighting,
false-negative masks (text ids; GISTEmbed's margin, scored by a guide or by the model), the joint symmetric loss,
reverse columns and Matryoshka dimensions.

1. The reference against implementations written independently of it: sentence-transformers'
   MultipleNegativesRankingLoss (every hardness mode, both directions, both partition modes, a gathered batch),
   GISTEmbedLoss (its anchor-positive and anchor-negative blocks, both margin strategies), a hand-built masked
   cross-entropy, and the Matryoshka sum of MNRL on truncated embeddings (what sentence-transformers'
   MatryoshkaLoss computes).
2. The C++ kernels against the reference: loss, statistics and every gradient, on fresh random inputs of odd shapes,
   through the fused forward+backward (reductions mean / sum) and the streaming forward + recomputing backward
   (reduction none, symmetric, more columns than a stripe holds).

Tolerances. float64 (most cases): the kernels and the reference compute the same function and differ only by the
order of summation: per the bound of test_cpu_many_columns_fall_back_to_recomputation, (2·7·sqrt(M) + 2(d + 3)/τ +
16)·u of the terms' sums, ≈ 1e-12 for these shapes (u = 1.1e-16); atol = rtol = 1e-10 leaves a 100× margin, while a
wrong mask, penalty, bias or coefficient moves the results by ≥ 1e-4. The masks are discontinuous (a threshold): a
random float64 cosine lies within 1e-12 of a threshold with probability ~1e-12, so both sides mask the same columns.
Against sentence-transformers (float64 too, the same formula summed in another order): 1e-12. float32: 1e-5 × the
Matryoshka weights' sum, the fp32 tolerance of the other contrastive-loss tests (each dimension's loss carries that
error, weighted).
"""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.ops import Guide, _cpp, contrastive_loss
from fastprompt.ops.reference import contrastive_loss_reference

needs_cpp = pytest.mark.skipif(not _cpp.available(), reason="fastprompt._C (the C++ extension) is not built")
F64 = dict(atol=1e-10, rtol=1e-10)


def make(n, m2, d, k, dtype=torch.float64, seed=0, rev=False, dg=None):
    """z1 (n, d), z2 (m2, d), z3 (k, m2, d) or None, reverse columns (m2, d) or None, and guide embeddings of
    width dg (or None)."""
    g = torch.Generator().manual_seed(seed)
    z1, z2 = torch.randn(n, d, generator=g, dtype=dtype), torch.randn(m2, d, generator=g, dtype=dtype)
    z3 = torch.randn(k, m2, d, generator=g, dtype=dtype) if k else None
    r = torch.randn(m2, d, generator=g, dtype=dtype) if rev else None
    guide = None
    if dg:
        guide = Guide(torch.randn(n, dg, generator=g, dtype=dtype), torch.randn(m2, dg, generator=g, dtype=dtype),
                      torch.randn(k, m2, dg, generator=g, dtype=dtype) if k else None,
                      torch.randn(m2, dg, generator=g, dtype=dtype) if rev else None)
    return [z.requires_grad_() if z is not None else None for z in (z1, z2, z3, r)], guide


def run(zs, backend, guide=None, seed=1, **kw):
    """Loss, stats and the gradients (of every differentiable input) of sum(loss * random weights)."""
    z1, z2, z3, rev = zs
    loss, stats = contrastive_loss(z1, z2, z3, reverse_columns=rev, guide=guide, backend=backend, return_stats=True,
                                   **kw)
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=loss.dtype) + 0.5
    leaves = [z for z in zs if z is not None]
    return loss.detach(), stats, torch.autograd.grad((loss * w).sum(), leaves)


def assert_same(out, ref, tol, check_index=True):
    torch.testing.assert_close(out[0], ref[0], **tol)
    for name in ("lse", "pos_sim", "hardest_neg_sim", "lse_sym"):
        a, b = getattr(out[1], name), getattr(ref[1], name)
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, **tol, msg=name)
    if check_index:
        assert torch.equal(out[1].hardest_neg_index, ref[1].hardest_neg_index)
    for i, (a, b) in enumerate(zip(out[2], ref[2])):
        torch.testing.assert_close(a, b, **tol, msg=f"gradient {i}")


def text_ids(n, m2, k, seed=3):
    """Column ids with duplicates (values from a small range) and one column without text (-1); the positives'
    ids are >= 0. Anchor ids likewise."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, max(3, (m2 * (1 + k)) // 3), (m2 * (1 + k),), generator=g)
    ids[-1] = -1
    return ids, torch.randint(0, max(2, m2 // 2), (m2,), generator=g)


# ------------------------------------------------------------------------------------------------
# 1. the reference against independent implementations

def st_util():
    return pytest.importorskip("sentence_transformers").util


def st_mnrl(directions, partition_mode, hardness_mode, strength, scale=20.0):
    """sentence-transformers' MultipleNegativesRankingLoss without a model (compute_loss_from_embeddings only)."""
    st_util()
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    loss = MultipleNegativesRankingLoss.__new__(MultipleNegativesRankingLoss)
    torch.nn.Module.__init__(loss)
    loss.scale, loss.similarity_fct, loss.gather_across_devices = scale, st_util().cos_sim, False
    loss.directions, loss.partition_mode = directions, partition_mode
    loss.hardness_mode, loss.hardness_strength = hardness_mode, strength
    return loss


HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]
DIRECTIONS = [(("query_to_doc",), "joint"), (("query_to_doc", "doc_to_query"), "joint"),
              (("query_to_doc", "doc_to_query"), "per_direction")]


@pytest.mark.parametrize("hardness_mode", HARDNESS)
@pytest.mark.parametrize("directions,partition_mode", DIRECTIONS)
@pytest.mark.parametrize("k", [0, 1, 3])
def test_reference_equals_sentence_transformers_mnrl(hardness_mode, directions, partition_mode, k):
    (z1, z2, z3, _), _ = make(7, 7, 11, k)
    mnrl = st_mnrl(directions, partition_mode, hardness_mode, 4.5, scale=25.0)
    expected = mnrl.compute_loss_from_embeddings([z1, z2] + (list(z3) if k else []), None)
    got = contrastive_loss_reference(z1, z2, z3, temperature=1 / 25.0, hardness_mode=hardness_mode,
                                     hardness_strength=4.5, symmetric=len(directions) == 2,
                                     partition_mode=partition_mode)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    leaves = [z for z in (z1, z2, z3) if z is not None]
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("hardness_mode", ["all_negatives", "hard_negatives"])
@pytest.mark.parametrize("directions,partition_mode", DIRECTIONS[1:])
def test_reference_equals_gathered_mnrl_on_rank_1(monkeypatch, hardness_mode, directions, partition_mode):
    """gather_across_devices on rank 1 of 2 (the gather simulated as sentence-transformers' own tests do): the
    local anchors against every process's candidates (positive_offset = rank · n), the reverse term against every
    process's anchors (reverse_columns)."""
    st_util()
    import sentence_transformers.sentence_transformer.losses.multiple_negatives_ranking as mod

    n, d, k = 5, 9, 2
    (z1, z2, z3, _), _ = make(n, n, d, k)
    others = [torch.randn(n, d, generator=torch.Generator().manual_seed(9 + i), dtype=torch.float64)
              for i in range(2 + k)]  # rank 0's anchors, positives, negatives
    local = [z1, z2] + list(z3)
    blocks = {id(z): other for z, other in zip(local, others)}
    monkeypatch.setattr(mod, "all_gather_with_grad", lambda t: torch.cat([blocks[id(t)], t]))
    monkeypatch.setattr(mod, "get_rank", lambda: 1)
    mnrl = st_mnrl(directions, partition_mode, hardness_mode, 3.0)
    mnrl.gather_across_devices = True
    expected = mnrl.compute_loss_from_embeddings(local, None)
    gathered = [torch.cat([o, z]) for o, z in zip(others, local)]
    got = contrastive_loss_reference(z1, gathered[1], torch.stack(gathered[2:]), temperature=0.05,
                                     hardness_mode=hardness_mode, hardness_strength=3.0, symmetric=True,
                                     partition_mode=partition_mode, reverse_columns=gathered[0], positive_offset=n)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)
    for a, b in zip(torch.autograd.grad(got, local), torch.autograd.grad(expected, local)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def st_gist(margin, strategy):
    """sentence-transformers' GISTEmbedLoss on given embeddings, without contrast_anchors / contrast_positives (its
    anchor-positive and anchor-negative blocks: the columns of the op), as its own tests build it."""
    st_util()
    from sentence_transformers.sentence_transformer.losses import GISTEmbedLoss

    loss = GISTEmbedLoss.__new__(GISTEmbedLoss)
    torch.nn.Module.__init__(loss)
    loss.temperature, loss.similarity_fct = 0.01, torch.nn.CosineSimilarity(dim=-1)
    loss.margin_strategy, loss.margin = strategy, margin
    loss.contrast_anchors = loss.contrast_positives = loss.gather_across_devices = loss.must_retokenize = False
    loss.cross_entropy_loss = torch.nn.CrossEntropyLoss()
    loss.model = lambda f: {"sentence_embedding": f["model"]}
    loss.guide = lambda f: {"sentence_embedding": f["guide"]}
    return loss


@pytest.mark.parametrize("margin,strategy", [(0.0, "absolute"), (0.1, "absolute"), (0.05, "relative")])
@pytest.mark.parametrize("k", [0, 1])
def test_reference_equals_gist_embed_guide_mask(margin, strategy, k):
    """GISTEmbed's rule: a column whose *guide* cosine exceeds the guide's anchor-positive cosine minus the margin
    (or minus |cos| · margin) is left out; the positive never is. The guide is correlated with the model (the
    same vectors plus noise), so the mask removes some columns but not all."""
    (z1, z2, z3, _), _ = make(9, 9, 12, k)
    noise = torch.Generator().manual_seed(4)
    guide = [z.detach() + 0.8 * torch.randn(z.shape, generator=noise, dtype=z.dtype) for z in (z1, z2, z3)
             if z is not None]
    feats = [{"model": z, "guide": g} for z, g in zip([z1, z2] + ([z3[0]] if k else []),
                                                      guide[:2] + ([guide[2][0]] if k else []))]
    expected = st_gist(margin, strategy)(feats, None)
    got, stats = contrastive_loss_reference(z1, z2, z3, temperature=0.01, fn_margin=margin,
                                            fn_margin_strategy=strategy,
                                            guide=Guide(guide[0], guide[1], guide[2] if k else None),
                                            return_stats=True)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    leaves = [z for z in (z1, z2, z3) if z is not None]
    for a, b in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(expected, leaves)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_reference_text_id_mask_is_a_masked_cross_entropy():
    """column_ids: the columns carrying the positive's id (other than the positive) and those without text (id < 0)
    drop out of the softmax; anchor_ids do the same for the reverse term's columns."""
    n, k = 8, 2
    (z1, z2, z3, _), _ = make(n, n, 6, k)
    ids, anchor_ids = text_ids(n, n, k)
    cols = torch.cat([z2, z3.reshape(-1, 6)])
    cos = F.normalize(z1, dim=-1) @ F.normalize(cols, dim=-1).T
    drop = (ids[None, :] == ids[:n, None]) | (ids[None, :] < 0)
    drop[torch.arange(n), torch.arange(n)] = False
    assert drop.sum() > n  # the ids do mask columns
    forward = F.cross_entropy((cos / 0.1).masked_fill(drop, float("-inf")), torch.arange(n), reduction="none")
    rcos = F.normalize(z2, dim=-1) @ F.normalize(z1, dim=-1).T
    rdrop = (anchor_ids[None, :] == anchor_ids[:, None]) & ~torch.eye(n, dtype=torch.bool)
    reverse = F.cross_entropy((rcos / 0.1).masked_fill(rdrop, float("-inf")), torch.arange(n), reduction="none")
    got = contrastive_loss_reference(z1, z2, z3, temperature=0.1, column_ids=ids, anchor_ids=anchor_ids,
                                     symmetric=True, reduction="none")
    torch.testing.assert_close(got, 0.5 * (forward + reverse), atol=1e-12, rtol=1e-12)


def test_reference_matryoshka_is_the_weighted_sum_of_truncated_mnrl():
    """matryoshka_dims: Σ_t w_t · loss(embeddings truncated to d_t), each prefix re-normalised: sentence-transformers'
    MatryoshkaLoss around MNRL (here its inner loss called on truncated embeddings), hardness included."""
    (z1, z2, z3, _), _ = make(6, 6, 16, 2)
    dims, weights = [16, 8, 3], [1.0, 0.5, 2.0]
    mnrl = st_mnrl(("query_to_doc",), "joint", "all_negatives", 2.0)
    expected = sum(w * mnrl.compute_loss_from_embeddings([z[..., :t] for z in [z1, z2, *z3]], None)
                   for t, w in zip(dims, weights))
    got = contrastive_loss_reference(z1, z2, z3, hardness_mode="all_negatives", hardness_strength=2.0,
                                     matryoshka_dims=dims, matryoshka_weights=weights)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def test_reference_masked_hardest_negative_and_no_negative_left():
    """The hardest negative is taken among the columns left in the softmax; with every negative masked a row's
    cross-entropy is 0, its hinge 0 and its hardest index -1."""
    (z1, z2, _, _), _ = make(4, 4, 5, 0)
    kw = dict(hinge_weight=1.0, hinge_margin=5.0, reduction="none", return_stats=True)
    # rows 1..3 share their positive's text: their only negative left is column 0
    _, stats = contrastive_loss_reference(z1, z2, column_ids=torch.tensor([0, 1, 1, 1]), **kw)
    assert torch.equal(stats.hardest_neg_index[1:], torch.zeros(3, dtype=torch.int64))
    loss, stats = contrastive_loss_reference(z1, z2, column_ids=torch.tensor([7, 7, 7, 7]), **kw)
    assert torch.equal(stats.hardest_neg_index, torch.full((4,), -1))
    assert torch.equal(loss, torch.zeros(4, dtype=loss.dtype))


# ------------------------------------------------------------------------------------------------
# 2. the C++ kernels against the reference

CASES = [
    # n, m2, d, k, options (odd shapes; rows and columns over several blocks / tiles where it matters)
    (5, 9, 7, 3, dict(positive_offset=3, hard_negative_weight=0.4, hinge_weight=2.0)),
    (130, 300, 19, 2, dict(positive_offset=77, hardness_mode="all_negatives", hardness_strength=5.0)),
    (9, 9, 13, 1, dict(hardness_mode="in_batch_negatives", hardness_strength=9.0, hinge_weight=1.0)),
    (9, 9, 13, 2, dict(hardness_mode="hard_negatives", hardness_strength=5.0, hard_negative_weight=-0.3)),
    (11, 11, 10, 2, dict(symmetric=True, partition_mode="joint", hardness_mode="all_negatives",
                         hardness_strength=3.0)),
    (6, 14, 8, 1, dict(symmetric=True, rev=True, positive_offset=8, hinge_weight=1.0)),
    (6, 14, 8, 1, dict(symmetric=True, partition_mode="joint", rev=True, positive_offset=4)),
    (12, 12, 9, 2, dict(ids=True, hinge_weight=3.0, hinge_margin=0.9)),
    (12, 12, 9, 2, dict(ids=True, symmetric=True, partition_mode="joint")),
    (10, 10, 12, 1, dict(fn_margin=0.1, hinge_weight=1.0)),
    (10, 10, 12, 2, dict(fn_margin=0.05, fn_margin_strategy="relative", symmetric=True)),
    (10, 16, 12, 2, dict(fn_margin=0.0, dg=7, positive_offset=6)),
    (8, 8, 12, 1, dict(fn_margin=0.02, dg=5, symmetric=True, rev=True, partition_mode="joint")),
    (9, 9, 17, 2, dict(matryoshka_dims=[17, 5, 11], matryoshka_weights=[1.0, 0.25, 2.0], hinge_weight=1.0)),
    (9, 9, 17, 1, dict(matryoshka_dims=[4, 9], fn_margin=0.1, symmetric=True, hardness_mode="all_negatives",
                       hardness_strength=2.0)),
    (140, 270, 20, 1, dict(matryoshka_dims=[20, 6], ids=True, hardness_mode="in_batch_negatives",
                           hardness_strength=4.0, hinge_weight=2.0)),
]


def case_args(n, m2, d, k, kw, dtype=torch.float64, seed=0):
    kw = dict(kw)
    zs, guide = make(n, m2, d, k, dtype=dtype, seed=seed, rev=kw.pop("rev", False), dg=kw.pop("dg", None))
    if kw.pop("ids", False):
        ids, anchor_ids = text_ids(n, m2, k)
        kw["column_ids"] = ids
        if kw.get("symmetric"):
            kw["anchor_ids"] = anchor_ids if zs[3] is not None else anchor_ids[:n]
    return zs, guide, kw


def case_id(case):
    n, m2, d, k, kw = case
    return f"n{n}-m{m2}-d{d}-k{k}-" + "-".join(sorted(kw))


@needs_cpp
@pytest.mark.parametrize("reduction", ["mean", "none"], ids=["fused", "streaming"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cpu_matches_reference(case, reduction):
    zs, guide, kw = case_args(*case)
    ref = run(zs, "reference", guide, reduction=reduction, **kw)
    out = run(zs, "cpu", guide, reduction=reduction, **kw)
    assert_same(out, ref, F64)


@needs_cpp
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[13]], ids=case_id)
def test_cpu_matches_reference_float32(case):
    zs, guide, kw = case_args(*case, dtype=torch.float32)
    tol = 1e-5 * sum(kw.get("matryoshka_weights", [1.0]))
    assert_same(run(zs, "cpu", guide, **kw), run(zs, "reference", guide, **kw), dict(atol=tol, rtol=tol),
                check_index=False)


@needs_cpp
def test_cpu_gradcheck_float64_every_option():
    """Finite differences through the recomputing backward (reduction none) with k = 2, text ids, the joint
    symmetric term over reverse columns and two Matryoshka dimensions. (Not with hardness weighting: its penalty is
    a constant of the gradient by definition, stop_grad(cos), so finite differences disagree with it on purpose;
    its gradients are checked against sentence-transformers' autograd above.)"""
    (z1, z2, z3, rev), _ = make(4, 6, 5, 2, rev=True)
    ids, anchor_ids = text_ids(4, 6, 2)

    def f(a, b, c, r):
        return contrastive_loss(a, b, c, backend="cpu", positive_offset=2, temperature=0.3, hinge_weight=2.0,
                                hinge_margin=0.9, hard_negative_weight=0.4, symmetric=True, partition_mode="joint",
                                reverse_columns=r, column_ids=ids, anchor_ids=anchor_ids, matryoshka_dims=[5, 2],
                                reduction="none")

    assert torch.autograd.gradcheck(f, (z1, z2, z3, rev), eps=1e-6, atol=1e-7)


@needs_cpp
def test_cpu_many_columns_with_matryoshka_fall_back_to_recomputation():
    """The fused pass keeps (D + 1) stripes of M columns per row block: with two Matryoshka dimensions and k = 2,
    M = 90,000 columns exceed the 16-row budget, so the gradients come from the recomputing backward."""
    zs, guide, kw = case_args(20, 30_000, 8, 2, dict(matryoshka_dims=[8, 3], hinge_weight=1.0,
                                                      hardness_mode="all_negatives", hardness_strength=2.0))
    assert (len(kw["matryoshka_dims"]) + 1) * 3 * 30_000 > (1 << 22) // 16
    assert_same(run(zs, "cpu", guide, **kw), run(zs, "reference", guide, **kw), F64)


@needs_cpp
@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_any_thread_count_matches_reference_with_options(threads):
    """The thread-count-dependent splits (rounds of stripes, Latin-square groups) with every option on."""
    zs, guide, kw = case_args(600, 600, 10, 2, dict(matryoshka_dims=[10, 4], ids=True, hinge_weight=1.0,
                                                    hardness_mode="all_negatives", hardness_strength=3.0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for reduction in ("mean", "none"):
            assert_same(run(zs, "cpu", guide, reduction=reduction, **kw),
                        run(zs, "reference", guide, reduction=reduction, **kw), F64)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_cpp)])
def test_anchor_chunks_sum_to_the_whole_batch(backend):
    """The split a loss-stage gradient cache or an all-gather makes: chunks of anchors, each against every column
    (positive_offset = the chunk's first row) and, for the reverse term, against every anchor (reverse_columns),
    with the ids and guide rows of the whole batch. Their summed losses and gradients are the whole batch's."""
    n, k = 13, 2
    (z1, z2, z3, _), guide = make(n, n, 10, k, dg=6)
    guide = guide._replace(reverse_columns=guide.z1)
    ids, anchor_ids = text_ids(n, n, k)
    kw = dict(column_ids=ids, anchor_ids=anchor_ids[:n], symmetric=True, partition_mode="joint", fn_margin=0.1,
              hardness_mode="all_negatives", hardness_strength=3.0, matryoshka_dims=[10, 4], hinge_weight=1.0,
              hard_negative_weight=0.2, reduction="sum", backend=backend)
    whole = contrastive_loss(z1, z2, z3, guide=guide._replace(reverse_columns=None), **kw)
    expected = torch.autograd.grad(whole, (z1, z2, z3))
    total = 0.0
    for begin, end in ((0, 5), (5, 6), (6, 13)):
        g = guide._replace(z1=guide.z1[begin:end])
        total = total + contrastive_loss(z1[begin:end], z2, z3, reverse_columns=z1, guide=g, positive_offset=begin,
                                         **kw)
    torch.testing.assert_close(total, whole, **F64)
    for a, b in zip(torch.autograd.grad(total, (z1, z2, z3)), expected):
        torch.testing.assert_close(a, b, **F64)


@needs_cpp
def test_two_dimensional_z3_is_one_negative_per_row():
    """The old call contrastive_loss(z1, z2, z3) with z3 (M2, d) is k = 1: z3[None]."""
    (z1, z2, z3, _), _ = make(6, 6, 5, 1)
    a = contrastive_loss(z1, z2, z3[0], hard_negative_weight=0.7, backend="cpu")
    b = contrastive_loss(z1, z2, z3, hard_negative_weight=0.7, backend="cpu")
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    (g,) = torch.autograd.grad(a, z3)
    assert g.shape == z3.shape


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_cpp)])
def test_matryoshka_stats_follow_the_callers_order(backend):
    (z1, z2, z3, _), _ = make(5, 5, 9, 1)
    _, stats = contrastive_loss(z1, z2, z3, matryoshka_dims=[9, 3, 6], backend=backend, return_stats=True)
    assert stats.lse.shape == (5, 3) and stats.hardest_neg_index.shape == (5, 3)
    for t, dim in enumerate([9, 3, 6]):
        _, one = contrastive_loss(z1[:, :dim], z2[:, :dim], z3[..., :dim], backend=backend, return_stats=True)
        torch.testing.assert_close(stats.pos_sim[:, t], one.pos_sim, **F64)
        assert torch.equal(stats.hardest_neg_index[:, t], one.hardest_neg_index)


# ------------------------------------------------------------------------------------------------
# errors


def _z(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("args,kw,match", [
    ((_z(4, 3), _z(4, 3), _z(2, 5, 3)), {}, "rows per negative"),
    ((_z(4, 3), _z(4, 3), _z(2, 4, 5)), {}, "dim 5"),
    ((_z(4, 3), _z(4, 3)), dict(reverse_columns=_z(4, 3)), "symmetric=True"),
    ((_z(4, 3), _z(6, 3)), dict(symmetric=True, reverse_columns=_z(5, 3), positive_offset=2), "reverse_columns"),
    ((_z(4, 3), _z(4, 3)), dict(hardness_mode="hard"), "hardness_mode"),
    ((_z(4, 3), _z(4, 3)), dict(hardness_strength=-1.0), "hardness_strength"),
    ((_z(4, 3), _z(4, 3)), dict(partition_mode="both"), "partition_mode"),
    ((_z(4, 3), _z(4, 3)), dict(column_ids=torch.arange(5)), "one id per column"),
    ((_z(4, 3), _z(4, 3)), dict(column_ids=torch.arange(4).float()), "int64"),
    ((_z(4, 3), _z(4, 3)), dict(column_ids=torch.tensor([0, -1, 2, 3])), "positives must be >= 0"),
    ((_z(4, 3), _z(4, 3)), dict(column_ids=torch.arange(4), symmetric=True), "anchor_ids"),
    ((_z(4, 3), _z(4, 3)), dict(anchor_ids=torch.arange(4)), "anchor_ids"),
    ((_z(4, 3), _z(4, 3)), dict(fn_margin=float("inf")), "fn_margin"),
    ((_z(4, 3), _z(4, 3)), dict(fn_margin=0.1, fn_margin_strategy="ratio"), "fn_margin_strategy"),
    ((_z(4, 3), _z(4, 3)), dict(guide=Guide(_z(4, 2), _z(4, 2))), "set fn_margin"),
    ((_z(4, 3), _z(4, 3)), dict(fn_margin=0.0, guide=Guide(_z(4, 2), _z(5, 2))), "guide.z2 must have 4 rows"),
    ((_z(4, 3), _z(4, 3), _z(4, 3)), dict(fn_margin=0.0, guide=Guide(_z(4, 2), _z(4, 2))), "guide.z3"),
    ((_z(4, 3), _z(4, 3)), dict(fn_margin=0.0, guide=Guide(_z(4, 2), _z(4, 3))), "guide has dim 2"),
    ((_z(4, 3), _z(4, 3)), dict(matryoshka_dims=[4]), "matryoshka_dims"),
    ((_z(4, 3), _z(4, 3)), dict(matryoshka_dims=[2, 2]), "distinct"),
    ((_z(4, 3), _z(4, 3)), dict(matryoshka_dims=[3, 2], matryoshka_weights=[1.0]), "matryoshka_weights"),
    ((_z(4, 3), _z(4, 3)), dict(matryoshka_weights=[1.0]), "need matryoshka_dims"),
])
def test_bad_options_raise_value_error(args, kw, match):
    with pytest.raises(ValueError, match=match):
        contrastive_loss(*args, **kw)

"""fastprompt.ops.contrastive_loss (fastprompt/ops/contrastive.py): the reference against the papers' formulas,
the C++ CPU kernel against the reference (loss, statistics and every gradient), the torch.library registration,
the errors."""
import logging

import pytest
import torch
import torch.nn.functional as F

from fastprompt import backends
from fastprompt.ops import _cpp, contrastive_loss
from fastprompt.ops import contrastive as cl_mod
from fastprompt.ops.reference import contrastive_loss_reference

needs_cpp = pytest.mark.skipif(not _cpp.available(), reason="fastprompt._C (the C++ extension) is not built")


def make_inputs(n, m2, d, z3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(n, d, generator=g, dtype=dtype), torch.randn(m2, d, generator=g, dtype=dtype)]
    if z3:
        zs.append(torch.randn(m2, d, generator=g, dtype=dtype))
    return [z.requires_grad_() for z in zs]


def loss_and_grads(zs, backend, seed=1, **kw):
    """Loss, stats and the gradients of sum(loss * random weights) (covers reduction='none' fully)."""
    for z in zs:
        z.grad = None
    loss, stats = contrastive_loss(*zs, backend=backend, return_stats=True, **kw)
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=loss.dtype) + 0.5
    (loss * w).sum().backward()
    return loss.detach(), stats, [z.grad.clone() for z in zs]


def assert_matches(zs, backend, atol=1e-5, rtol=1e-5, check_index=True, **kw):
    ref = loss_and_grads(zs, "reference", **kw)
    out = loss_and_grads(zs, backend, **kw)
    torch.testing.assert_close(out[0], ref[0], atol=atol, rtol=rtol)
    for name in ("lse", "pos_sim", "hardest_neg_sim"):
        torch.testing.assert_close(getattr(out[1], name), getattr(ref[1], name), atol=atol, rtol=rtol, msg=name)
    if kw.get("symmetric"):
        torch.testing.assert_close(out[1].lse_sym, ref[1].lse_sym, atol=atol, rtol=rtol)
    if check_index:
        assert torch.equal(out[1].hardest_neg_index, ref[1].hardest_neg_index)
    for i, (a, b) in enumerate(zip(out[2], ref[2])):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=f"grad of z{i + 1}")
    return ref, out


# ------------------------------------------------------------------------------------------------
# the reference is the papers' loss


@pytest.mark.parametrize("hard_negative_weight", [0.0, 0.7])
def test_reference_matches_simcse_and_promcse_formulas(hard_negative_weight):
    """SimCSE: CE over cos/temp (+ weight on each anchor's own hard negative); PromCSE cl_forward:
    MarginRankingLoss between the positive and the max over the masked [z1·z2 | z1·z3] cosines, total =
    CE + w * hinge."""
    z1, z2, z3 = make_inputs(12, 12, 20, True)
    temp, margin, weight = 0.05, 0.2, 10.0
    cos = F.cosine_similarity(z1[:, None], torch.cat([z2, z3])[None], dim=-1)
    logits = cos / temp
    # SimCSE's cl_forward, literally: the weight sits on the diagonal of the z1·z3 block
    weights = torch.tensor([[0.0] * 12 + [0.0] * i + [hard_negative_weight] + [0.0] * (12 - i - 1)
                            for i in range(12)])
    logits = logits + weights
    ce = F.cross_entropy(logits, torch.arange(12))
    pos = cos.diagonal()[:, None]
    masked = torch.cat([cos[:, :12] - 1e9 * torch.eye(12), cos[:, 12:]], 1)
    hardest = masked.max(1, keepdim=True)[0]
    eh = torch.nn.MarginRankingLoss(margin=margin)(pos, hardest, torch.ones_like(pos))
    expected = ce + weight * eh
    got = contrastive_loss_reference(z1, z2, z3, temperature=temp, hard_negative_weight=hard_negative_weight,
                                     hinge_margin=margin, hinge_weight=weight)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)
    g_exp = torch.autograd.grad(expected, [z1, z2, z3])
    g_got = torch.autograd.grad(got, [z1, z2, z3])
    for a, b in zip(g_got, g_exp):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_reference_symmetric_is_the_clip_average():
    z1, z2 = make_inputs(9, 9, 7, False)
    s = F.normalize(z1, dim=-1) @ F.normalize(z2, dim=-1).T / 0.1
    labels = torch.arange(9)
    expected = 0.5 * (F.cross_entropy(s, labels) + F.cross_entropy(s.T, labels))
    got = contrastive_loss_reference(z1, z2, temperature=0.1, symmetric=True)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_reference_gathered_columns_equal_the_square_loss_rows():
    """The rows of a process (offset into all-gathered columns) get the losses of the full square batch."""
    z1, z2, z3 = make_inputs(12, 12, 8, True)
    full = contrastive_loss_reference(z1, z2, z3, reduction="none", hinge_weight=2.0, hard_negative_weight=0.3)
    part = contrastive_loss_reference(z1[4:8], z2, z3, reduction="none", hinge_weight=2.0, hard_negative_weight=0.3,
                                      positive_offset=4)
    torch.testing.assert_close(part, full[4:8], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# C++ kernel against the reference

CPU_CASES = [
    # n, m2, d, z3, offset, options
    (1, 1, 5, True, 0, dict(hinge_weight=1.0)),
    (1, 4, 3, False, 2, dict()),
    (2, 2, 1, False, 0, dict(symmetric=True)),
    (7, 7, 13, True, 0, dict(hinge_weight=10.0, hard_negative_weight=0.5)),
    (129, 129, 97, False, 0, dict(symmetric=True, hinge_weight=3.0, reduction="sum")),
    (130, 300, 64, True, 77, dict(symmetric=True, hinge_weight=10.0, hard_negative_weight=-0.4, reduction="none")),
    (257, 257, 1024, True, 0, dict(hinge_weight=10.0, hinge_margin=0.5)),
    (300, 300, 33, False, 0, dict(temperature=1.0)),
    (2049, 2049, 17, True, 0, dict(hinge_weight=10.0, symmetric=True)),
    # each anchor's own hard negative z3[offset + i] spread over several column tiles: fused pass, then
    # forward without the hardest negative + recomputing backward
    (300, 520, 40, True, 150, dict(hard_negative_weight=1.3)),
    (300, 520, 40, True, 150, dict(hard_negative_weight=2.0, reduction="none")),
]


@needs_cpp
@pytest.mark.parametrize("n,m2,d,z3,offset,kw", CPU_CASES)
def test_cpu_matches_reference(n, m2, d, z3, offset, kw):
    assert_matches(make_inputs(n, m2, d, z3), "cpu", positive_offset=offset, **kw)


@needs_cpp
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_cpu_without_stats_matches_reference(reduction):
    """No stats and no hinge: the forward skips the hardest-negative search (its own row pass)."""
    kw = dict(positive_offset=150, hard_negative_weight=1.7, reduction=reduction)
    zs = make_inputs(300, 520, 40, True)
    got = contrastive_loss(*zs, backend="cpu", **kw)
    grads = torch.autograd.grad(got.sum(), zs)
    ref = contrastive_loss_reference(*zs, **kw)
    ref_grads = torch.autograd.grad(ref.sum(), zs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(contrastive_loss(*zs, backend="cpu", **kw), ref.detach(), atol=1e-5, rtol=1e-5)


@needs_cpp
@pytest.mark.parametrize("temperature", [1e-3, 20.0])
def test_cpu_extreme_temperatures(temperature):
    # float64: exact agreement; float32: the loss's sensitivity to a cosine error grows as 1/temperature
    assert_matches(make_inputs(70, 70, 40, True, dtype=torch.float64), "cpu", atol=1e-9, rtol=1e-9,
                   temperature=temperature, hinge_weight=5.0, symmetric=True)
    tol = 1e-5 * max(1.0, 0.05 / temperature)
    assert_matches(make_inputs(70, 70, 40, True), "cpu", atol=tol, rtol=tol, temperature=temperature,
                   hinge_weight=5.0)


@needs_cpp
def test_cpu_half_inputs_are_computed_in_float32():
    zs = make_inputs(40, 40, 24, True, dtype=torch.bfloat16)
    ref, out = assert_matches(zs, "cpu", atol=1e-2, rtol=1e-2, check_index=False, hinge_weight=1.0)
    assert out[0].dtype == torch.float32 and all(g.dtype == torch.bfloat16 for g in out[2])


def tied_inputs(dtype=torch.float32):
    """Integer-valued rows: every dot product is exact, so duplicated columns give bitwise equal cosines."""
    g = torch.Generator().manual_seed(3)
    z1 = torch.randint(-3, 4, (10, 6), generator=g).to(dtype)
    z2 = torch.randint(-3, 4, (10, 6), generator=g).to(dtype)
    z3 = torch.randint(-3, 4, (10, 6), generator=g).to(dtype)
    z2[7] = z2[2]  # duplicate in-batch columns
    z3[4] = z2[2]  # and a hard negative equal to them
    z3[0] = z3[9]
    z1[5] = z1[1]  # duplicate anchors
    z1[z1.norm(dim=1) == 0, 0] = 1.0
    return [z.requires_grad_() for z in (z1, z2, z3)]


def check_ties(backend):
    zs = tied_inputs()
    kw = dict(hinge_weight=10.0, hinge_margin=2.0)  # a margin of 2 keeps every hinge active
    loss, stats, grads = loss_and_grads(zs, backend, **kw)
    ref = loss_and_grads(zs, "reference", **kw)
    torch.testing.assert_close(loss, ref[0], atol=1e-5, rtol=1e-5)
    # the rule: the lowest column index among the exact maxima (positive excluded)
    cols = torch.cat([zs[1], zs[2]]).detach().double()
    cos = F.normalize(zs[0].detach().double(), dim=-1) @ F.normalize(cols, dim=-1).T
    cos[torch.arange(10), torch.arange(10)] = -2
    best = cos.max(1, keepdim=True)[0]
    expected_idx = torch.where(cos >= best - 1e-12, torch.arange(20), 99).min(1)[0]
    assert torch.equal(stats.hardest_neg_index, expected_idx)
    # gradients agree up to which of identical columns receives the hinge: compare column-group sums
    torch.testing.assert_close(grads[0], ref[2][0], atol=1e-5, rtol=1e-5)
    dcols, dref = torch.cat(grads[1:]), torch.cat(ref[2][1:])
    for group in ([2, 7, 14], [10, 19]):
        torch.testing.assert_close(dcols[group].sum(0), dref[group].sum(0), atol=1e-5, rtol=1e-5)
    others = [j for j in range(20) if j not in (2, 7, 14, 10, 19)]
    torch.testing.assert_close(dcols[others], dref[others], atol=1e-5, rtol=1e-5)


@needs_cpp
def test_cpu_ties_pick_the_lowest_index():
    check_ties("cpu")


@needs_cpp
def test_cpu_gradcheck_float64():
    z1, z2, z3 = make_inputs(5, 8, 6, True, dtype=torch.float64)

    def f(a, b, c):
        return contrastive_loss(a, b, c, backend="cpu", positive_offset=2, temperature=0.3, hinge_weight=2.0,
                                hinge_margin=0.9, hard_negative_weight=0.4, symmetric=True, reduction="none")

    assert torch.autograd.gradcheck(f, (z1, z2, z3), eps=1e-6, atol=1e-7)


@needs_cpp
def test_cpu_gradcheck_float64_fused_forward_backward():
    """reduction mean/sum: the gradients come from the forward's fused pass, rescaled in backward."""
    z1, z2, z3 = make_inputs(6, 9, 5, True, dtype=torch.float64)

    def f(a, b, c):
        return 3.0 * contrastive_loss(a, b, c, backend="cpu", positive_offset=3, temperature=0.3, hinge_weight=2.0,
                                      hinge_margin=0.9, hard_negative_weight=0.4, reduction="sum")

    assert torch.autograd.gradcheck(f, (z1, z2, z3), eps=1e-6, atol=1e-7)


@needs_cpp
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cpu_plain_backward_matches_reference(reduction):
    """loss.backward() with a unit gradient: the fused pass's gradients are returned as they are."""
    zs = make_inputs(50, 50, 20, True)
    grads = []
    for backend in ("cpu", "reference"):
        for z in zs:
            z.grad = None
        contrastive_loss(*zs, backend=backend, hinge_weight=10.0, reduction=reduction).backward()
        grads.append([z.grad.clone() for z in zs])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def cosine_gradient_sums(z1, z2, temperature, hinge_margin, hinge_weight, weight):
    """Sums of |dL/dcos_ij| (float64) over the columns of each anchor and over the anchors of each column, for
    ``weight`` x the mean loss of two views (positives on the diagonal): the gradient w.r.t. z1[i] is
    r_i * P_i sum_j dL/dcos_ij z2[j] / |z2[j]| (P_i: projection off z1[i]), so these sums bound its terms."""
    n = len(z1)
    cos = (F.normalize(z1, dim=-1) @ F.normalize(z2, dim=-1).T).requires_grad_()
    ce = F.cross_entropy(cos / temperature, torch.arange(n), reduction="none")
    hardest = cos.masked_fill(torch.eye(n, cos.shape[1], dtype=torch.bool), float("-inf")).max(1).values
    loss = weight * (ce + hinge_weight * torch.relu(hinge_margin + hardest - cos.diagonal())).mean()
    (g,) = torch.autograd.grad(loss, cos)
    return g.abs().sum(1), g.abs().sum(0)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cpu_many_columns_fall_back_to_recomputation(dtype):
    """Columns too many for a per-thread stripe of logits (> 4M elements at 16 rows): the gradients come
    from the tile-recomputing backward instead of the fused pass, with the same results.

    Compared with the float64 reference under a rounding bound (the path is the same in both dtypes: the stripe
    budget counts elements). The gradient of z1[i] sums M = 270,000 terms dL/dcos_ij z2[j]/|z2[j]|: any order of
    summation is within lam sqrt(M) u sum_j |dL/dcos_ij| of the exact value with probability >= 1 - 2M exp(-lam^2/2)
    (Higham & Mary 2019, Thm 3.1; lam = 7: 1e-5), and the log-sum-exp that normalises each term has the same error;
    each cosine (d terms) is off by (d + 3) u, which the logits divide by the temperature, twice (the term and the
    lse). So the bound is r_i * S_i * (2 lam sqrt(M) + 2 (d + 3) / temperature + 16) u, S_i the sum above (16 u:
    normalisations, scalings), ~5e-4 of S_i in float32. (A fixed 1e-5 against the float32 reference held only where
    MKL's AVX-512 kernels sum more accurately: with 3-dimensional inputs both the float32 reference and the kernel
    are ~1e-4 off float64 on AVX2/SSE code paths; those inputs also had hardest negatives tied within 2e-7.)"""
    n, m, d, temperature, hinge_weight = 20, 270_000, 16, 0.05, 1.0
    zs = make_inputs(n, m, d, False, dtype=dtype)
    z64 = [z.detach().double().requires_grad_() for z in zs]
    weight = 0.75
    kw = dict(temperature=temperature, hinge_weight=hinge_weight)
    loss, stats = contrastive_loss(*zs, backend="cpu", return_stats=True, **kw)
    grads = torch.autograd.grad(loss * weight, zs)
    ref_loss, ref_stats = contrastive_loss(*z64, backend="reference", return_stats=True, **kw)
    ref_grads = torch.autograd.grad(ref_loss * weight, z64)
    # no rounding-level near-tie in the discontinuous choices of the hinge (d = 16 spreads the columns)
    cos = F.normalize(z64[0].detach(), dim=-1) @ F.normalize(z64[1].detach(), dim=-1).T
    top2 = cos.masked_fill(torch.eye(n, m, dtype=torch.bool), float("-inf")).topk(2, dim=1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4 and (0.2 + top2[:, 0] - cos.diagonal()).abs().min() > 1e-4
    assert torch.equal(stats.hardest_neg_index, ref_stats.hardest_neg_index)

    u = torch.finfo(dtype).eps / 2
    ulps = 2 * 7 * m ** 0.5 + 2 * (d + 3) / temperature + 16
    rows, cols = cosine_gradient_sums(*(z.detach() for z in z64), temperature, 0.2, hinge_weight, weight)
    r = [1 / z.detach().norm(dim=1, keepdim=True) for z in z64]
    for name, got, ref, bound in (("z1", grads[0], ref_grads[0], r[0] * rows[:, None]),
                                  ("z2", grads[1], ref_grads[1], r[1] * cols[:, None])):
        err = (got.double() - ref).abs()
        assert (err <= ulps * u * bound).all(), f"grad of {name}: {(err / (ulps * u * bound)).max():.2f} x the bound"
    # the loss: the lse and the positive's and the hardest negative's logits, each within the same ulps
    assert abs(float(loss.detach()) - float(ref_loss.detach())) <= (2 + hinge_weight) * ulps * u
    for name in ("lse", "pos_sim", "hardest_neg_sim"):
        err = (getattr(stats, name).double() - getattr(ref_stats, name)).abs().max()
        assert err <= ulps * u, f"{name}: {err}"


@needs_cpp
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cpu_any_thread_count_matches_reference(threads, reduction):
    """The work split depends on the thread count: row blocks run in rounds of T stripes whose dB updates follow a
    Latin square (mean: the fused pass; 4 blocks over 3 threads leave the last round short), and the recomputing
    backward (none) hands out T-dependent groups of row blocks x column tiles. Every split must give the reference's
    result. float64: rounding is ~(2 * 7 * sqrt(M) + 2 * (d + 3) / temperature) u ~ 1e-12 of the gradients' term
    sums (see the many-columns test); a block skipped or counted twice changes them by >= 1e-3."""
    zs = make_inputs(4 * 256 - 10, 4 * 256 - 10, 8, True, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches(zs, "cpu", atol=1e-9, rtol=1e-9, hinge_weight=10.0, hard_negative_weight=0.5,
                       reduction=reduction)
    finally:
        torch.set_num_threads(before)


@needs_cpp
def test_cpu_zero_vector_rows():
    """A zero row has cosine 0 with everything (norm floored at eps, as F.normalize): finite, same grads."""
    zs = make_inputs(6, 6, 5, True)
    with torch.no_grad():
        zs[0][2] = 0.0
        zs[1][4] = 0.0
    assert_matches(zs, "cpu", hinge_weight=1.0)


@needs_cpp
def test_cpu_backward_is_deterministic():
    zs = make_inputs(300, 300, 48, True)
    a = loss_and_grads(zs, "cpu", hinge_weight=1.0)[2]
    b = loss_and_grads(zs, "cpu", hinge_weight=1.0)[2]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# registration: one opaque node for torch.compile, fake tensors, autograd


@needs_cpp
@pytest.mark.parametrize("symmetric,grad_weight", [(True, 0.0), (False, 0.25)])
def test_opcheck_forward_op(symmetric, grad_weight):
    """Schema, fake tensors, autograd registration; grad_weight > 0 is the fused forward+backward. Every optional
    input is present: two negatives per row, reverse columns, text ids, a guide, two Matryoshka dimensions."""
    z1, z2, z3 = make_inputs(6, 9, 5, True)
    z3 = torch.stack([z3.detach(), z3.detach().flip(0)]).requires_grad_()
    g = torch.Generator().manual_seed(2)
    rev = torch.randn(9, 5, generator=g).requires_grad_() if symmetric else None
    ids = torch.randint(0, 20, (27,), generator=g)
    anchor_ids = torch.arange(9) if symmetric else None
    guide = (torch.randn(6, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(2, 9, 4, generator=g),
             torch.randn(9, 4, generator=g) if symmetric else None)
    args = (z1, z2, z3, rev, ids, anchor_ids, *guide, [3, 5], [0.5, 1.0], 0.1, 0.3, 1.0, 2.0, 0.2, False, 0.2, 2.0,
            symmetric, symmetric, 1, "cpu", False, grad_weight)
    torch.library.opcheck(torch.ops.fastprompt.contrastive_loss_fwd.default, args)


@needs_cpp
def test_torch_compile_sees_one_opaque_node():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(a, b, c):
        return contrastive_loss(a, b, c, backend="cpu", hinge_weight=1.0)

    zs = make_inputs(16, 16, 8, True)
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    out = compiled(*zs)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fastprompt.contrastive_loss_fwd.default) == 1
    assert not any("mm" in str(t) or "logsumexp" in str(t) for t in targets)
    torch.testing.assert_close(out, f(*zs))
    grads = torch.autograd.grad(out, zs)
    ref = torch.autograd.grad(contrastive_loss(*zs, backend="reference", hinge_weight=1.0), zs)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_auto_falls_back_to_reference_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(_cpp, "_state", {"tried": True, "module": None, "error": ImportError("not built")})
    monkeypatch.setattr(backends, "_WARNED", set())
    zs = make_inputs(8, 8, 4, True)
    with caplog.at_level(logging.WARNING, logger="fastprompt.backends"):
        a = contrastive_loss(*zs, hinge_weight=1.0)
        b = contrastive_loss(*zs, hinge_weight=1.0)
    warnings = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(warnings) == 1
    assert "contrastive_loss" in warnings[0].getMessage() and "not built" in warnings[0].getMessage()
    expected = contrastive_loss_reference(*zs, hinge_weight=1.0)
    torch.testing.assert_close(a, expected)
    torch.testing.assert_close(b, expected)
    with pytest.raises(backends.BackendUnavailableError, match="fastprompt._C"):
        contrastive_loss(*zs, backend="cpu")


@needs_cpp
def test_auto_on_cpu_uses_the_cpp_kernel(monkeypatch):
    calls = []
    real = cl_mod._kernel_fwd
    monkeypatch.setattr(cl_mod, "_kernel_fwd", lambda *a: calls.append(a[7].backend) or real(*a))
    contrastive_loss(*make_inputs(4, 4, 3, False))
    assert calls == ["cpu"]


# ------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("make,kw,match", [
    (lambda: (torch.randn(4, 3), torch.randn(4, 5)), {}, "dim 5"),
    (lambda: (torch.randn(4), torch.randn(4, 3)), {}, "2-D"),
    (lambda: (torch.randn(4, 3), torch.randn(3, 3)), {}, "at least as many rows"),
    (lambda: (torch.randn(4, 3), torch.randn(4, 3), torch.randn(5, 3)), {}, "z3 must have as many rows"),
    (lambda: (torch.randn(1, 3), torch.randn(1, 3)), {}, "at least 2 columns"),
    (lambda: (torch.randn(1, 3), torch.randn(3, 3)), dict(symmetric=True), "symmetric"),
    (lambda: (torch.randn(2, 3), torch.randn(4, 3)), dict(positive_offset=3), "positive_offset"),
    (lambda: (torch.randn(2, 3), torch.randn(2, 3, dtype=torch.float64)), {}, "float64"),
    (lambda: (torch.randint(0, 3, (2, 3)), torch.randn(2, 3)), {}, "floating-point"),
    (lambda: (torch.tensor([[1.0, float("nan")], [0.0, 1.0]]), torch.randn(2, 2)), {}, "NaN or Inf"),
    (lambda: (torch.randn(2, 2), torch.tensor([[1.0, float("inf")], [0.0, 1.0]])), {}, "z2 contains NaN"),
    (lambda: (torch.randn(2, 3), torch.randn(2, 3)), dict(reduction="avg"), "reduction"),
    (lambda: (torch.randn(2, 3), torch.randn(2, 3)), dict(backend="cuda"), "backend"),
    (lambda: (torch.randn(2, 3), torch.randn(2, 3)), dict(temperature=0.0), "temperature"),
    (lambda: (torch.randn(2, 3), torch.randn(2, 3)), dict(hinge_weight=float("nan")), "hinge_weight"),
    (lambda: (torch.randn(2, 3), torch.randn(2, 3)), dict(hinge_weight=-1.0), "hinge_weight"),
])
def test_bad_input_raises_value_error(make, kw, match):
    with pytest.raises(ValueError, match=match):
        contrastive_loss(*make(), **kw)


def test_stats_shapes_and_dtypes():
    zs = make_inputs(5, 7, 3, True)
    loss, stats = contrastive_loss(*zs, positive_offset=2, return_stats=True, reduction="none", backend="reference")
    assert loss.shape == (5,) and stats.lse.shape == (5,) and stats.hardest_neg_index.dtype == torch.int64
    assert stats.lse_sym is None
    assert ((stats.hardest_neg_index >= 0) & (stats.hardest_neg_index < 14)).all()
    assert not (stats.hardest_neg_index == torch.arange(5) + 2).any()  # never the positive

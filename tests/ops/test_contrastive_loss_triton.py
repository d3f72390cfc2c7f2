"""The Triton kernels of contrastive_loss under the CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py)
against the plain-PyTorch reference: loss, statistics and every gradient, on both Triton backends: ``"triton"`` (the
fused kernels: statistics with the columns split across programs; with a gradient and reduction mean/sum the stripe
path's epilogue, else the streaming backward) and ``"chunked"`` (cuBLAS products, here torch.mm on the CPU, with the
Triton epilogue). Grids are kept tiny (the interpreter costs ~20 ms per program instance); the interpreter tiles are
16 x 16 (x 32 along d), so the shapes below cover partial row / column / d blocks, several column tiles, column splits
(the interpreter's stand-in of 2 SMs splits a single row tile's columns in up to 4), both column segments, and with a
small stripe budget several row chunks."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fastprompt.kernels import contrastive_loss as tk  # noqa: E402

from fastprompt.ops import contrastive_loss  # noqa: E402

from .test_contrastive_loss_features import assert_same, case_args, run  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.interpreting(), reason="needs TRITON_INTERPRET=1 at import (tests/conftest.py)")

BACKENDS = ["triton", "chunked"]


def small_stripe(kib: int):
    """A stripe budget of ``kib`` KiB: several row chunks on the tests' shapes (the Triton backend streams where
    one 16-row tile does not fit)."""
    return tk.override_configs(epilogue=tk.LaunchConfig(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, STRIPE_KIB=kib),
                                                        num_stages=1, maxnreg=None))


def make_inputs(n, m2, d, z3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    zs = [torch.randn(n, d, generator=g).to(dtype), torch.randn(m2, d, generator=g).to(dtype)]
    if z3:
        zs.append(torch.randn(m2, d, generator=g).to(dtype))
    return [z.requires_grad_() for z in zs]


def loss_and_grads(zs, backend, **kw):
    for z in zs:
        z.grad = None
    loss, stats = contrastive_loss(*zs, backend=backend, return_stats=True, **kw)
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1), dtype=loss.dtype) + 0.5
    (loss * w).sum().backward()
    return loss.detach(), stats, [z.grad.clone() for z in zs]


CASES = [
    # n, m2, d, z3, offset, options
    (1, 1, 5, True, 0, dict(hinge_weight=1.0)),
    (8, 8, 16, False, 0, dict()),
    (17, 40, 33, True, 9, dict(symmetric=True, hinge_weight=10.0, hard_negative_weight=0.5, reduction="none")),
    (33, 33, 70, True, 0, dict(hinge_weight=10.0, hard_negative_weight=-0.3)),
    (20, 20, 1, False, 0, dict(symmetric=True)),
    (5, 37, 100, False, 32, dict(reduction="sum", hinge_weight=2.0, hinge_margin=0.6)),
]


# the chunked backend shares the epilogue with the Triton one (its options: FEATURE_CASES below): here the cases
# that reach other corners (one column, reduction none with a symmetric offset, a sum with gathered columns)
BACKEND_CASES = ([("triton", case) for case in CASES]
                 + [("chunked", case) for case in (CASES[0], CASES[2], CASES[5])])


@pytest.mark.parametrize("backend,case", BACKEND_CASES, ids=[f"{b}-{i}" for i, (b, _) in enumerate(BACKEND_CASES)])
def test_triton_matches_reference_fp32(backend, case):
    n, m2, d, z3, offset, kw = case
    zs = make_inputs(n, m2, d, z3)
    ref = loss_and_grads(zs, "reference", positive_offset=offset, **kw)
    out = loss_and_grads(zs, backend, positive_offset=offset, **kw)
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    for name in ("lse", "pos_sim", "hardest_neg_sim"):
        torch.testing.assert_close(getattr(out[1], name), getattr(ref[1], name), atol=1e-5, rtol=1e-5)
    if d > 1:  # d = 1: every cosine is +-1, the hardest negative is an arbitrary one of many exact ties
        assert torch.equal(out[1].hardest_neg_index, ref[1].hardest_neg_index)
    for a, b in zip(out[2], ref[2]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_triton_half_precision(dtype, tol, backend):
    """Half inputs against the reference on the same (rounded) inputs, computed in fp32 by both."""
    zs = make_inputs(24, 24, 40, True, dtype=dtype)
    kw = dict(hinge_weight=10.0, symmetric=True, temperature=0.1)
    ref = loss_and_grads(zs, "reference", **kw)
    out = loss_and_grads(zs, backend, **kw)
    torch.testing.assert_close(out[0], ref[0], atol=tol, rtol=tol)
    for a, b in zip(out[2], ref[2]):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("temperature", [1e-3, 20.0])
def test_triton_extreme_temperatures(temperature):
    zs = make_inputs(20, 20, 24, True)
    tol = 1e-5 * max(1.0, 0.05 / temperature)  # a cosine rounding error is amplified by 1 / temperature
    ref = loss_and_grads(zs, "reference", temperature=temperature, hinge_weight=3.0)
    out = loss_and_grads(zs, "triton", temperature=temperature, hinge_weight=3.0)
    torch.testing.assert_close(out[0], ref[0], atol=tol, rtol=tol)
    for a, b in zip(out[2], ref[2]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_ties_pick_the_lowest_index(backend):
    """Integer rows make every dot product exact, so duplicated columns tie bitwise across tiles (and across the
    column splits of the statistics kernel: 3 tiles of 16 columns, up to 4 splits)."""
    g = torch.Generator().manual_seed(3)
    z1, z2, z3 = (torch.randint(-3, 4, (20, 6), generator=g).float() for _ in range(3))
    z2[17] = z2[2]  # same column in another 16-wide tile
    z3[4] = z2[2]  # and in the other segment
    for z in (z1, z2, z3):
        z[z.norm(dim=1) == 0, 0] = 1.0
    _, stats = contrastive_loss(z1, z2, z3, backend=backend, return_stats=True, hinge_weight=1.0)
    cos = F.normalize(z1.double(), dim=-1) @ F.normalize(torch.cat([z2, z3]).double(), dim=-1).T
    cos[torch.arange(20), torch.arange(20)] = -2
    expected = torch.where(cos >= cos.max(1, keepdim=True)[0] - 1e-12, torch.arange(40), 99).min(1)[0]
    assert torch.equal(stats.hardest_neg_index, expected)


def test_triton_stats_outputs_are_written_everywhere():
    """The launchers poison outputs with NaN / -1: every entry must be overwritten by the kernels (two segments,
    two Matryoshka dimensions, text ids and a model-scored margin on)."""
    z1, z2, z3 = (z.detach() for z in make_inputs(19, 19, 9, True))
    dims = [4, 9]
    r = [torch.stack([1 / z[:, :t].norm(dim=1) for t in dims]) for z in (z1, z2, z3)]
    ids = torch.arange(38)
    thr = torch.full((2, 19), 0.5)
    problem = (z1, r[0], [z2, z3], r[1:], dims, ids[:19], [ids[:19], ids[19:]], None, [None, None], thr, 0, 20.0,
               0.3, 1.0, 2.0)
    lse, pos, hard, idx = tk.stats(*problem, True)
    for t in (lse, pos, hard):
        assert torch.isfinite(t).all()
    assert (idx >= 0).all()
    coefficients = (lse, torch.ones(2, 19), torch.ones(2, 19), torch.ones(2, 19), idx)
    for t in tk.grads(*problem, *coefficients):
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-3)])
def test_triton_zero_rows_stay_finite(dtype, tol, backend):
    """A zero embedding has cosine 0 with everything (norm floored at eps); its 1/eps inverse norm must not
    overflow the half-precision products of the backward into NaN. (The zero row's own gradient is
    dA / eps, which overflows fp16 to inf in the reference as well.)"""
    zs = make_inputs(18, 18, 12, True, dtype=dtype)
    with torch.no_grad():
        zs[0][3] = 0.0
        zs[1][5] = 0.0
        zs[2][17] = 0.0
    ref = loss_and_grads(zs, "reference", hinge_weight=1.0)
    out = loss_and_grads(zs, backend, hinge_weight=1.0)
    torch.testing.assert_close(out[0], ref[0], atol=tol, rtol=tol)
    for a, b, zero in zip(out[2], ref[2], (3, 5, 17)):
        assert not torch.isnan(a).any()
        if dtype == torch.float16:  # the zero row's dA / eps amplifies half-precision rounding 1e8-fold
            a, b = torch.cat([a[:zero], a[zero + 1:]]), torch.cat([b[:zero], b[zero + 1:]])
        else:  # fp32: the zero row's dA / eps (~1e2 here) is a cancelling sum of unit vectors: its rounding is
            # relative to its largest entry, not to each (the GPU tests' rule, tests/ops/test_ops_cuda.py)
            torch.testing.assert_close(a[zero], b[zero], atol=tol * b[zero].abs().max().item(), rtol=tol)
            a, b = torch.cat([a[:zero], a[zero + 1:]]), torch.cat([b[:zero], b[zero + 1:]])
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------
# the embedding-training options (tests/ops/test_contrastive_loss_features.py has their reference checks)

FEATURE_CASES = [
    # n, m2, d, k, options: partial blocks in every direction, both segments, each option at least once
    (9, 20, 13, 2, dict(positive_offset=7, hard_negative_weight=0.4, hardness_mode="all_negatives",
                        hardness_strength=5.0, hinge_weight=2.0)),
    (17, 17, 10, 1, dict(hardness_mode="in_batch_negatives", hardness_strength=9.0, symmetric=True,
                         partition_mode="joint")),
    (6, 14, 8, 1, dict(symmetric=True, rev=True, positive_offset=8, hardness_mode="hard_negatives",
                       hardness_strength=5.0)),
    (12, 12, 9, 2, dict(ids=True, symmetric=True, hinge_weight=3.0, hinge_margin=0.9)),
    (10, 10, 12, 1, dict(fn_margin=0.05, fn_margin_strategy="relative", hinge_weight=1.0)),
    (10, 16, 12, 2, dict(fn_margin=0.0, dg=7, positive_offset=6, symmetric=True, rev=True)),
    (9, 9, 37, 2, dict(matryoshka_dims=[37, 5, 20], matryoshka_weights=[1.0, 0.25, 2.0], hinge_weight=1.0,
                       ids=True)),
    (9, 9, 17, 1, dict(matryoshka_dims=[4, 9], fn_margin=0.1, symmetric=True)),
]


def _feature_case(n, m2, d, k, kw, dtype):
    zs, guide, kw = case_args(n, m2, d, k, kw, dtype=torch.float32)
    zs = [None if z is None else z.detach().to(dtype).requires_grad_() for z in zs]
    if guide is not None:
        guide = type(guide)(*(None if g is None else g.to(dtype) for g in guide))
    return zs, guide, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: "-".join(sorted(c[4])))
def test_triton_options_match_reference_fp32(case, backend):
    """fp32, 1e-5 x the Matryoshka weights' sum (each dimension's loss carries the fp32 error of the cases
    above). Statistics too: hardest-negative indices compared exactly (random inputs: no near ties)."""
    zs, guide, kw = _feature_case(*case, torch.float32)
    tol = 1e-5 * sum(kw.get("matryoshka_weights", [1.0]))
    assert_same(run(zs, backend, guide, **kw), run(zs, "reference", guide, **kw), dict(atol=tol, rtol=tol))


@pytest.mark.parametrize("backend,kib,reduction", [("triton", 1, "mean"), ("triton", 6, "none"),
                                                   ("chunked", 6, "mean"), ("chunked", 6, "none")])
def test_triton_row_chunks_and_the_streaming_backward(backend, kib, reduction):
    """Every option at once under a small stripe budget: on the chunked backend (and the Triton backend at 6 KiB:
    16-row chunks of 2 dimensions x 48 columns, 20 rows) the rows go through several chunks, forward (mean:
    gradient in the forward) or backward (none: the recomputing stripe pass); at 1 KiB not one 16-row tile fits and
    the Triton backend takes its streaming backward (the row and column passes)."""
    kw = dict(ids=True, fn_margin=0.1, hardness_mode="all_negatives", hardness_strength=3.0, matryoshka_dims=[12, 5],
              hinge_weight=1.0, hard_negative_weight=0.5, symmetric=True, partition_mode="joint", positive_offset=3,
              reduction=reduction)
    zs, guide, kw = _feature_case(20, 24, 12, 1, kw, torch.float32)
    tol = 2e-5
    with small_stripe(kib):
        out = run(zs, backend, guide, **kw)
    assert_same(out, run(zs, "reference", guide, **kw), dict(atol=tol, rtol=tol))


@pytest.mark.parametrize("backend", BACKENDS)
def test_triton_options_half_precision(backend):
    """fp16 with every option at once, against the reference on the same rounded inputs (1e-3 per dimension's
    loss, the fp16 tolerance above). The guide is scored in fp16 too; the margin is wide enough that no
    guide cosine lies within fp16 rounding of a threshold."""
    kw = dict(ids=True, dg=6, fn_margin=0.3, hardness_mode="all_negatives", hardness_strength=3.0,
              matryoshka_dims=[16, 6], hinge_weight=1.0, hard_negative_weight=0.5, symmetric=True, rev=True,
              positive_offset=4, temperature=0.1)
    zs, guide, kw = _feature_case(12, 16, 16, 2, kw, torch.float16)
    tol = 2e-3
    assert_same(run(zs, backend, guide, **kw), run(zs, "reference", guide, **kw), dict(atol=tol, rtol=tol),
                check_index=False)

"""The fused dropout + residual add + LayerNorm CPU op (csrc/dropout_add_norm.cpp, fastprompt/ops/add_norm.py)
against the plain-PyTorch reference (fastprompt.ops.reference.dropout_add_layer_norm_reference) given the op's own
keep decisions, which are checked against an independent Python Philox4x32-10 (itself checked against
Random123's known-answer vectors).

Tolerance: the op computes in float32, the reference here in float64 on the same float32 inputs. The op's error
is its float32 rounding: the row mean and variance are sums of C terms (kLanes partial sums), each off by
<= C * 2^-24 relative in the worst case and ~sqrt(C) * 2^-24 typically; xhat = (s - mean) * rstd then carries a
few ulps relative to its O(1) value, y = xhat * w + b a few more of |w| + |b| <= ~5 (standard normal weights).
The backward's two row means are the same kind of sums. So each entry is within ~8 * sqrt(C) * 2^-24 * (1 + |y|)
for C <= 1000 (~1.5e-5 at C = 1000 for |y| ~ 5, measured <= 4e-6); the weight and bias gradients sum N rows of
such terms (~sqrt(N) more). The bound used: atol = rtol = 2e-5 for outputs and input gradients, and
2e-5 * sqrt(N) for the parameter gradients. A wrong keep bit moves an entry by O(1), a wrong row statistic by O(0.1).
"""
import math

import pytest
import torch

from fastprompt.ops import _cpp, add_norm
from fastprompt.ops.reference import dropout_add_layer_norm_reference

from .philox_reference import M32, philox, seed_words

pytestmark = pytest.mark.skipif(not _cpp.available(), reason=str(_cpp.missing_reason()))


# (N, C): one element, C below a byte of bits (7) and below the 16 partial sums, C = 37 (rows start at every
# offset into a Philox counter's four words), MiniLM's 384, a long row.
SHAPES = [(1, 1), (2, 7), (9, 16), (17, 37), (64, 384), (5, 1000)]


def python_keep(element: int, dropout_p: float, seed: int) -> bool:
    """The documented decision of flat element ``element`` (csrc/dropout_add_norm.cpp's header)."""
    _, hi, key = seed_words(seed)
    q = element // 4
    word = philox((q & M32, q >> 32, hi, 0), key)[element % 4]
    return word >= min(round(dropout_p * 2**32), M32)


def test_python_philox_gives_random123_known_answers():
    assert philox((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert philox((M32,) * 4, (M32, M32)) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)
    assert philox((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == \
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


@pytest.mark.parametrize("seed", [0, 12345, -7, 2**62 + 3], ids=str)
def test_keep_mask_is_the_documented_philox_decision(seed):
    rows, cols, p = 3, 37, 0.3
    keep = add_norm.keep_mask(rows, cols, p, seed)
    want = torch.tensor([python_keep(e, p, seed) for e in range(rows * cols)]).view(rows, cols)
    assert torch.equal(keep, want)


def test_keep_mask_depends_on_the_element_index_only_and_drops_p():
    seed, p = 99, 0.1
    assert torch.equal(add_norm.keep_mask(40, 96, p, seed).flatten(), add_norm.keep_mask(1, 40 * 96, p, seed)[0])
    assert not torch.equal(add_norm.keep_mask(40, 96, p, seed), add_norm.keep_mask(40, 96, p, seed + 1))
    n = 1 << 20
    dropped = int((~add_norm.keep_mask(1024, n // 1024, p, seed)).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(dropped - n * p) < 6 * sigma  # binomial: a wrong threshold (e.g. 0.1 of 2^31) is far outside


def make_inputs(N, C, seed=0, affine=True):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(N, C, generator=g).requires_grad_() for _ in range(2))
    w, b = ((torch.randn(C, generator=g).requires_grad_() for _ in range(2)) if affine else (None, None))
    return x, r, w, b


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}C{}".format(*s))
def test_matches_reference(shape, dropout_p, affine, isa, poisoned):
    N, C = shape
    x, r, w, b = make_inputs(N, C, affine=affine)
    eps = 1e-12
    y = add_norm.dropout_add_layer_norm(x, r, w, b, eps, dropout_p, seed=4321)
    dy = torch.randn(N, C, generator=torch.Generator().manual_seed(1))
    leaves = [t for t in (x, r, w, b) if t is not None]
    grads = torch.autograd.grad(y, leaves, dy)
    keep = add_norm.keep_mask(N, C, dropout_p, 4321) if dropout_p else None
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    rx, rr, *rwb = ref_leaves
    ry = dropout_add_layer_norm_reference(rx, rr, *(rwb or (None, None)), eps, dropout_p, keep)
    ref_grads = torch.autograd.grad(ry, ref_leaves, dy.double())
    torch.testing.assert_close(y.double(), ry, atol=2e-5, rtol=2e-5)
    for i, (got, want) in enumerate(zip(grads, ref_grads)):
        tol = 2e-5 * (math.sqrt(N) if i >= 2 else 1.0)
        assert got.dtype == torch.float32 and got.shape == leaves[i].shape
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=lambda m, i=i: f"grad {i}: {m}")


def test_leading_dimensions_and_gradients_only_where_asked():
    x = torch.randn(2, 5, 24, requires_grad=True)
    r = torch.randn(2, 5, 24)  # no gradient wanted
    w, b = torch.randn(24), torch.randn(24)
    y = add_norm.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.2, seed=3)
    assert y.shape == x.shape
    (gx,) = torch.autograd.grad(y.sum(), x)
    keep = add_norm.keep_mask(10, 24, 0.2, 3).view(2, 5, 24)
    xd = x.detach().double().requires_grad_()
    ry = dropout_add_layer_norm_reference(xd, r.double(), w.double(), b.double(), 1e-5, 0.2, keep)
    (rgx,) = torch.autograd.grad(ry.sum(), xd)
    torch.testing.assert_close(y.double(), ry, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(gx.double(), rgx, atol=2e-5, rtol=2e-5)
    assert (gx[~keep] == 0).all()  # a dropped element gets no gradient


def test_seed_comes_from_torch_generator():
    x, r, w, b = make_inputs(8, 40)
    state = torch.get_rng_state()
    y1 = add_norm.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.3)
    y2 = add_norm.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.3)
    torch.set_rng_state(state)
    y3 = add_norm.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.3)
    assert not torch.equal(y1, y2)  # a fresh seed per call
    assert torch.equal(y1, y3)  # replayed from the generator's state (resumed runs, checkpoint recomputation)


def test_thread_count_does_not_change_the_result():
    x, r, w, b = make_inputs(200, 384)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = add_norm.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.1, seed=5)
        g1 = torch.autograd.grad(y1.sum(), (x, r))
        torch.set_num_threads(max(2, threads))
        y2 = add_norm.dropout_add_layer_norm(x, r, w, b, 1e-5, 0.1, seed=5)
        g2 = torch.autograd.grad(y2.sum(), (x, r))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y1, y2) and all(torch.equal(a, c) for a, c in zip(g1, g2))


@pytest.mark.parametrize("case, match", [
    (dict(x=torch.randn(3, 4, dtype=torch.float64)), "float32 CPU"),
    (dict(dropout_p=1.0), "0 <= dropout_p < 1"),
    (dict(dropout_p=-0.1), "0 <= dropout_p < 1"),
    (dict(residual=torch.randn(3, 5)), "must have x's shape"),
    (dict(residual=torch.randn(3, 4, dtype=torch.float64)), "residual must be a float32 CPU tensor"),
    (dict(weight=torch.randn(5)), r"weight must be a float32 CPU tensor of shape \(4,\)"),
    (dict(bias=torch.randn(4, dtype=torch.float64)), "bias must be a float32 CPU tensor"),
], ids=["float64", "p=1", "p<0", "residual shape", "residual float64", "weight shape", "bias float64"])
def test_bad_input_raises(case, match):
    args = dict(x=torch.randn(3, 4), residual=torch.randn(3, 4), weight=torch.randn(4), bias=torch.randn(4),
                eps=1e-5, dropout_p=0.1)
    args.update(case)
    with pytest.raises(ValueError, match=match):
        add_norm.dropout_add_layer_norm(**args)

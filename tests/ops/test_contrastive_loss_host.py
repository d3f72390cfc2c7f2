"""The contrastive loss's CUDA host path, proven on the CPU: a call on the Triton backends (the interpreter runs the
kernels on CPU tensors, the launchers' Python is the CUDA path's) reads no tensor on the host, forward and backward,
with every option, and launches a bounded number of Triton kernels.

:class:`fastprompt.host_sync.HostReads` records every host read made from fastprompt's code (``.item()``,
``bool(t)``, ``.tolist()``, ``nonzero``, ``torch.tensor(list, device=...)``, ...) and switches the code onto the path
it takes on CUDA (value checks by ``torch._assert_async``); :class:`fastprompt.host_sync.TritonLaunches` counts the
launches. The first call of a configuration builds its cached tables (Matryoshka dims and weights), so each case is
called once before it is measured.
"""
import pytest
import torch

pytest.importorskip("triton")

from fastprompt.kernels import contrastive_loss as tk  # noqa: E402

from fastprompt.host_sync import HostReads, TritonLaunches, sync_free  # noqa: E402
from fastprompt.ops import Guide, contrastive_loss  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.interpreting(), reason="needs TRITON_INTERPRET=1 at import (tests/conftest.py)")

N, M2, D, K = 9, 12, 13, 2

# name -> (options, {backend: launches of one forward + backward}). The fused Triton path: the statistics kernel
# (which stores the stripe) and the epilogue per problem (the symmetric loss has two; "joint" takes the reverse
# problem's statistics once more first, for the shared normaliser); the chunked path: one epilogue per problem (and
# chunk: one here). Reduction "none" has no uniform upstream gradient: the statistics in the forward (Triton: one
# launch per problem; chunked: an epilogue), the stripe pass per problem in the backward.
CASES = {
    "plain": (dict(), {"triton": 2, "chunked": 1}),
    "hinge-hard-negatives": (dict(hinge_weight=2.0, hard_negative_weight=0.3, hardness_mode="all_negatives",
                                  hardness_strength=3.0), {"triton": 2, "chunked": 1}),
    "ids-symmetric-joint": (dict(ids=True, symmetric=True, partition_mode="joint"), {"triton": 5, "chunked": 3}),
    "guide-matryoshka": (dict(guide=True, fn_margin=0.1, matryoshka_dims=[13, 4], matryoshka_weights=[1.0, 0.5]),
                         {"triton": 2, "chunked": 1}),
    "model-margin-reverse": (dict(fn_margin=0.05, fn_margin_strategy="relative", symmetric=True, rev=True,
                                  positive_offset=3), {"triton": 4, "chunked": 2}),
    "none-reduction": (dict(reduction="none", hinge_weight=1.0, return_stats=True), {"triton": 3, "chunked": 2}),
}


def _inputs(kw):
    g = torch.Generator().manual_seed(0)
    kw = dict(kw)
    z1, z2 = torch.randn(N, D, generator=g), torch.randn(M2, D, generator=g)
    z3 = torch.randn(K, M2, D, generator=g)
    if kw.pop("rev", False):
        kw["reverse_columns"] = torch.randn(M2, D, generator=g).requires_grad_()
    if kw.pop("ids", False):
        kw["column_ids"] = torch.randint(0, M2, (M2 * (1 + K),), generator=g)
        kw["anchor_ids"] = torch.randint(0, N, (N,), generator=g)
    if kw.pop("guide", False):
        kw["guide"] = Guide(torch.randn(N, 5, generator=g), torch.randn(M2, 5, generator=g),
                            torch.randn(K, M2, 5, generator=g))
    return [z.requires_grad_() for z in (z1, z2, z3)], kw


def _step(zs, kw, backend):
    out = contrastive_loss(*zs, backend=backend, **kw)
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()


@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_no_host_read_and_a_launch_budget(case, backend):
    kw, budget = CASES[case]
    zs, kw = _inputs(kw)
    with sync_free():
        _step(zs, kw, backend)  # builds the cached tables of this configuration
    with HostReads() as reads, TritonLaunches() as launches:
        _step(zs, kw, backend)
    assert not reads.reads, reads.report()
    assert launches.total == budget[backend], launches.counts


def test_a_non_finite_input_is_a_device_side_assertion():
    """On the device path the finite check is ``torch._assert_async`` (on CPU tensors it raises at once; on CUDA at
    the next synchronisation), not a host read."""
    zs, _ = _inputs({})
    with torch.no_grad():
        zs[1][2, 3] = float("nan")
    with HostReads() as reads, pytest.raises(RuntimeError, match="z2 contains NaN or Inf"):
        contrastive_loss(*zs, backend="triton")
    assert not reads.reads
    with pytest.raises(ValueError, match="z2 contains NaN or Inf"):  # outside sync_free: the CPU's host check
        contrastive_loss(*zs, backend="triton")

"""The Triton prefix-attention kernels' grouped-query heads, causal / sliding-window token block, additive attention
bias and packed (variable-length) rows, under the CPU interpreter (TRITON_INTERPRET=1, tests/conftest.py), against
the reference (:func:`fastprompt.ops.reference.prefix_attention_reference`, whose docstring is the spec): output,
log-sum-exp and every gradient (q, k, v, prefix_k, prefix_v, attn_bias), dropout given the kernels' own mask,
packed rows equal to the same rows padded, the custom op's registration.

Grids are kept tiny (~20 ms per program instance). fp32 inputs run 16 x 16 tiles, so S = 40 has three row and
key tiles (the window skips whole tiles there); half-precision inputs run 32-row tiles.

Tolerances: ``close`` and ``ATTN_TOL`` of test_ops_cuda.py (the GPU kit's), against the reference in float32 on
the same rounded inputs: |got - want| <= tol * (|want| + max(1, max |want|)), since a rounding error is relative to
the largest terms summed, not to an entry that cancels. fp32, 1e-5: both sides sum the same O(1) products in other
orders; the largest sums here are the key/value gradients of a grouped-query head (group x S <= 4 x 40 rows) and
the prefix gradients (B x H x S <= 160 rows), a few ulps (~1e-7 relative) per term, ~1e-6 at most; the bias
gradient is dS itself (a D-term product), ~1e-7. A missed or extra key, a wrong window bound, head or sequence moves
entries by O(0.1). fp16, 1e-3: products of fp16 values are exact in the fp32 accumulator; probabilities and dS are
rounded to fp16 (2^-11 = 4.9e-4) before the second products (dq, dk sum such terms over keys or rows: their error
is relative to the sum of |terms|, hence the max-entry scale), outputs and gradients once more (another 4.9e-4).
bf16 (the interpreter's upcast switch, DESIGN.md): the same two roundings at 2^-8, 2e-2.
"""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from fastprompt.kernels import prefix_attention as kernels  # noqa: E402
from fastprompt.kernels._common import LaunchConfig  # noqa: E402

from fastprompt.host_sync import HostReads, TritonLaunches, sync_free  # noqa: E402
from fastprompt.ops import attention, prefix_attention, prefix_attention_varlen  # noqa: E402
from fastprompt.ops.attention import _kernel_attention  # noqa: E402
from fastprompt.ops.reference import prefix_attention_reference  # noqa: E402

from .philox_reference import keep_mask as philox_keep_mask  # noqa: E402
from .prefix_cases import make_inputs, op_seed, pack, packed_inputs  # noqa: E402
from .test_ops_cuda import ATTN_TOL, close  # noqa: E402
from .test_prefix_attention import triton_keep_mask  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.interpreting(), reason="needs TRITON_INTERPRET=1 at import "
                                                                   "(tests/conftest.py)")

fwd_op = torch.ops.fastprompt.prefix_attention_fwd
GRADS = ("dq", "dk", "dv", "dprefix_k", "dprefix_v", "dattn_bias")


def run_triton(q, k, v, pk, pv, mask, pidx, attn_bias, dout=None, dropout_p=0.0, seed=0, **kw):
    """The custom op's output, log-sum-exp and gradients (attn_bias' only when it requires grad), and dout."""
    out, lse = fwd_op(q, k, v, pk, pv, mask, pidx, q.shape[-1] ** -0.5, dropout_p, op_seed(seed), attn_bias=attn_bias,
                      **kw)
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    leaves = [q, k, v, pk, pv] + ([attn_bias] if attn_bias is not None and attn_bias.requires_grad else [])
    return out, lse, torch.autograd.grad(out, leaves, dout), dout


def run_reference(q, k, v, pk, pv, mask, pidx, attn_bias, dout, cu_seqlens=None, max_seqlen=None, causal=False,
                  window_left=-1, window_right=-1, **kw):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, pk, pv)]
    if attn_bias is not None and attn_bias.requires_grad:
        leaves.append(attn_bias.detach().float().requires_grad_())
    bias = None if attn_bias is None else leaves[5] if attn_bias.requires_grad else attn_bias.float()
    out, lse = prefix_attention_reference(*leaves[:5], mask, prompt_index=pidx, attn_bias=bias, causal=causal,
                                          window=(window_left, window_right), cu_seqlens=cu_seqlens,
                                          max_seqlen=max_seqlen, return_lse=True, **kw)
    return out, lse, torch.autograd.grad(out, leaves, dout.float())


def check(dtype, got, want, inputs):
    out, lse, grads, _ = got
    r_out, r_lse, r_grads = want
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    close("out", out, r_out, ATTN_TOL[dtype])
    assert torch.equal(torch.isinf(lse), torch.isinf(r_lse))  # rows that see nothing: -inf in both
    close("lse", lse[torch.isfinite(lse)], r_lse[torch.isfinite(r_lse)], ATTN_TOL[torch.float32])
    assert len(grads) == len(r_grads)
    for name, g, r, x in zip(GRADS, grads, r_grads, inputs):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        close(name, g, r, ATTN_TOL[dtype])  # a float32 bias' gradient too: dS = P (dP - rowsum(dO O)), O rounded


# ------------------------------------------------------------------------------------------------
# padded batches

# id: (B, H, Hkv, S, P, D, T, pad, causal, window, bias shape or None)
PADDED = {
    "gqa2-D24": (2, 4, 2, 9, 3, 24, None, "right", False, (-1, -1), None),
    "mqa3-prompts": (3, 3, 1, 6, 1, 16, 2, "right", False, (-1, -1), None),
    "S1-P0-causal": (2, 2, 2, 1, 0, 16, None, None, True, (-1, -1), None),
    "causal-leftpad-gqa": (2, 4, 2, 11, 2, 16, None, "left", True, (-1, -1), None),
    "window-tiles": (1, 2, 1, 40, 2, 16, None, None, False, (2, 17), None),
    "sliding-causal-P0": (2, 2, 2, 21, 0, 16, None, "right", True, (3, -1), None),
    "bias-1-1": (2, 2, 1, 7, 2, 16, None, "right", False, (-1, -1), (1, 1, 7, 7)),
    "bias-B-1-prompts": (3, 2, 2, 5, 3, 16, 2, "right", False, (-1, -1), (3, 1, 5, 5)),
    "bias-1-H-causal-mqa": (2, 4, 1, 8, 1, 16, None, "left", True, (-1, -1), (1, 4, 8, 8)),
    "bias-B-H-window-tiles": (2, 2, 2, 33, 2, 16, None, "right", False, (1, 20), (2, 2, 33, 33)),
}


@pytest.mark.parametrize("case", PADDED, ids=str)
def test_padded_fp32_matches_reference(case):
    B, H, Hkv, S, P, D, T, pad, causal, window, bias = PADDED[case]
    inputs = make_inputs(B, H, Hkv, S, P, D, T, pad=pad, bias=bias)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1])
    got = run_triton(*inputs, **kw)
    check(torch.float32, got, run_reference(*inputs, got[3], **kw), inputs[:5] + inputs[7:])


@pytest.mark.parametrize("dtype,case,bias_dtype", [
    (torch.float16, "gqa2-D24", None),
    (torch.float16, "causal-leftpad-gqa", None),
    (torch.float16, "bias-1-H-causal-mqa", None),
    (torch.float16, "bias-B-1-prompts", torch.float32),  # a float32 bias with half inputs is read as it is
    (torch.bfloat16, "bias-1-H-causal-mqa", None),
], ids=str)
def test_padded_half_matches_reference(dtype, case, bias_dtype):
    B, H, Hkv, S, P, D, T, pad, causal, window, bias = PADDED[case]
    inputs = make_inputs(B, H, Hkv, S, P, D, T, dtype, pad=pad, bias=bias, bias_dtype=bias_dtype)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1])
    got = run_triton(*inputs, **kw)
    check(dtype, got, run_reference(*inputs, got[3], **kw), inputs[:5] + inputs[7:])


@pytest.mark.parametrize("causal, window, poisoned, clean", [
    (True, (-1, -1), slice(32, 40), slice(0, 32)),  # causal: rows 0..31 never see key tile 32..39
    (True, (3, -1), slice(0, 16), slice(32, 40)),  # sliding window of 4: rows 32..39 never see key tile 0..15
], ids=["causal", "sliding"])
def test_hidden_token_tiles_are_never_read(causal, window, poisoned, clean):
    """Whole token tiles the window hides from a row tile are skipped, not loaded and masked: NaN values there
    (0 x NaN = NaN in any product that read them) leave those rows' outputs and dQ finite and right. fp32 tiles
    are 16 rows, S = 40: three row and key tiles."""
    q, k, v, pk, pv, _, _, _ = make_inputs(1, 1, 1, 40, 1, 16)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1])
    dout = torch.randn(1, 1, 40, 16, generator=torch.Generator().manual_seed(1))
    want, _, want_grads = run_reference(q, k, v, pk, pv, None, None, None, dout, **kw)
    with torch.no_grad():
        k[:, :, poisoned] = float("nan")
        v[:, :, poisoned] = float("nan")
    out, _ = fwd_op(q, k, v, pk, pv, None, None, 0.25, 0.0, op_seed(0), **kw)
    dq, = torch.autograd.grad(out, q, dout)
    close("out", out[:, :, clean], want[:, :, clean], ATTN_TOL[torch.float32])
    close("dq", dq[:, :, clean], want_grads[0][:, :, clean], ATTN_TOL[torch.float32])


def test_dropout_with_every_switch_matches_reference_given_the_kernel_mask():
    """Grouped-query heads, causal, bias and mixed prompts with dropout: the kernels drop what their Philox mask
    says (read back with the plain layout: the mask depends on (b, query head, row, column) only) in the forward
    and replay it in both backward kernels."""
    B, H, S, P, p, seed = 2, 4, 10, 3, 0.3, 77
    keep = triton_keep_mask(B, H, S, P, seed, p)
    inputs = make_inputs(B, H, 2, S, P, 16, T=2, pad="right", bias=(1, H, S, S))
    kw = dict(causal=True, window_left=4, window_right=-1)
    got = run_triton(*inputs, dropout_p=p, seed=seed, **kw)
    want = run_reference(*inputs, got[3], dropout_p=p, dropout_mask=keep, **kw)
    check(torch.float32, got, want, inputs[:5] + inputs[7:])


def test_bias_without_grad_costs_no_bias_gradient(monkeypatch):
    """A bias that does not require grad (a frozen backbone's): the backward is asked for no bias gradient."""
    calls = []
    real = kernels.backward
    monkeypatch.setattr(kernels, "backward", lambda *a, **kw: calls.append(kw["bias_grad"]) or real(*a, **kw))
    q, k, v, pk, pv, mask, pidx, bias = make_inputs(2, 2, 1, 6, 2, 16, pad="right", bias=(1, 2, 6, 6))
    bias = bias.detach()
    got = run_triton(q, k, v, pk, pv, mask, pidx, bias, causal=True)
    assert calls == [False] and len(got[2]) == 5
    _, _, r_grads = run_reference(q, k, v, pk, pv, mask, pidx, bias, got[3], causal=True)
    for name, g, r in zip(GRADS, got[2], r_grads):
        close(name, g, r, ATTN_TOL[torch.float32])
    out = fwd_op(q, k, v, pk, pv, mask, pidx, 0.25, 0.0, op_seed(0), attn_bias=bias.requires_grad_())
    torch.autograd.grad(out[0].sum(), (q, bias))
    assert calls == [False, True]


# ------------------------------------------------------------------------------------------------
# packed (variable-length) batches


# id: (lengths, H, Hkv, P, D, T, causal, window, bias: "B" / "1" for (B or 1, H, L, L) or None, L or None)
PACKED = {
    "all-length-1": ([1, 1, 1], 2, 1, 2, 16, None, True, (-1, -1), None, None),
    "all-equal-prompts": ([5, 5, 5], 4, 2, 3, 24, 2, False, (-1, -1), "1", None),
    "long-and-short-causal-bias": ([19, 1, 2, 1], 2, 2, 1, 16, None, True, (-1, -1), "B", None),
    "window-P0-L-above-longest": ([3, 6], 2, 1, 0, 16, None, False, (1, 1), None, 8),
}


@pytest.mark.parametrize("case", PACKED, ids=str)
def test_packed_fp32_matches_reference(case):
    lengths, H, Hkv, P, D, T, causal, window, bias, L = PACKED[case]
    L = L or max(lengths)
    bias_shape = None if bias is None else (len(lengths) if bias == "B" else 1, H, L, L)
    inputs, cu, L, _ = packed_inputs(lengths, H, Hkv, P, D, T, bias=bias_shape, L=L)
    kw = dict(causal=causal, window_left=window[0], window_right=window[1], cu_seqlens=cu, max_seqlen=L)
    got = run_triton(*inputs, **kw)
    assert got[0].shape == inputs[0].shape and got[1].shape == inputs[0].shape[:3]
    check(torch.float32, got, run_reference(*inputs, got[3], **kw), inputs[:5] + inputs[7:])


def test_packed_fp16_matches_reference():
    inputs, cu, L, _ = packed_inputs([9, 1, 4], 4, 2, 2, 16, T=2, dtype=torch.float16, bias=(1, 4, 9, 9))
    kw = dict(causal=True, cu_seqlens=cu.long(), max_seqlen=L)  # int64 offsets are taken as well
    got = run_triton(*inputs, **kw)
    check(torch.float16, got, run_reference(*inputs, got[3], **kw), inputs[:5] + inputs[7:])


def test_packed_equals_padded_with_dropout():
    """The same sequences packed and right-padded to L give the same output, log-sum-exp and gradients, with
    dropout on: the dropout counter counts rows from each sequence's start and columns of [prefix ; L tokens]
    in both layouts, so both drop the same probabilities. Bit for bit: the padded kernels only add exact zeros
    (masked keys, pad rows whose dout is zero)."""
    lengths, H, p, seed = [7, 1, 3, 5], 2, 0.3, 1234
    packed, cu, L, padded = packed_inputs(lengths, H, 1, 2, 16, T=2, bias=(len(lengths), H, 7, 7))
    kw = dict(causal=True, window_left=3, window_right=-1, dropout_p=p, seed=seed)
    dout = torch.randn(1, H, sum(lengths), 16, generator=torch.Generator().manual_seed(3))
    out, lse, grads, _ = run_triton(*packed, dout=dout, cu_seqlens=cu, max_seqlen=L, **kw)
    pad_dout = torch.zeros(len(lengths), H, L, 16)
    for b, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        pad_dout[b, :, :n] = dout[0, :, start:start + n]
    p_out, p_lse, p_grads, _ = run_triton(*padded, dout=pad_dout, **kw)
    with torch.no_grad():  # another seed, another mask
        other, _ = fwd_op(*packed[:7], 16 ** -0.5, p, op_seed(1), attn_bias=packed[7], causal=True, window_left=3,
                          cu_seqlens=cu, max_seqlen=L)
    assert not torch.equal(out, other)
    assert torch.equal(out, pack(p_out, lengths))
    assert torch.equal(lse, pack(p_lse[..., None], lengths)[..., 0])
    for name, g, r in zip(GRADS, grads, p_grads):
        assert torch.equal(g, pack(r, lengths) if name in ("dq", "dk", "dv") else r), name


def test_packed_through_the_backend_function_reads_max_seqlen():
    """prefix_attention's "triton" backend without max_seqlen reads it from cu_seqlens (once, in its check)."""
    inputs, cu, L, _ = packed_inputs([2, 6, 3], 2, 2, 1, 16)
    q, k, v, pk, pv = inputs[:5]
    out = prefix_attention_varlen(q, k, v, pk, pv, scale=0.25, causal=True, cu_seqlens=cu, backend="triton")
    want = prefix_attention_reference(q, k, v, pk, pv, scale=0.25, causal=True, cu_seqlens=cu)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("offsets, max_seqlen, n", [([0, 3, 9], 5, 9), ([0, 3, 8], 6, 9), ([1, 3, 9], 6, 9),
                                                    ([0, 5, 3, 9], 6, 9)],
                         ids=["longer-than-max", "short-of-N", "not-from-0", "decreasing"])
def test_packed_offsets_are_checked(offsets, max_seqlen, n):
    q = torch.zeros(1, 2, n, 16)
    pk = torch.zeros(2, 1, 16)
    with pytest.raises(ValueError, match="cu_seqlens must|more than max_seqlen"):
        prefix_attention_varlen(q, q, q, pk, pk, scale=1.0, cu_seqlens=torch.tensor(offsets), max_seqlen=max_seqlen,
                                backend="triton")


# ------------------------------------------------------------------------------------------------
# the dropout generator, the launches and the host path


@pytest.mark.parametrize("dtype, S, P", [(torch.float32, 12, 4), (torch.float32, 10, 3), (torch.float16, 36, 4),
                                         (torch.float16, 33, 6)],
                         ids=["fp32-aligned", "fp32-straddling", "fp16-aligned", "fp16-straddling"])
def test_dropout_mask_is_the_documented_philox_decision(dtype, S, P):
    """The forward's keep decisions, read back (q = 0, one-hot values), equal the Python Philox of the documented
    rule bit for bit: rows of P + S columns that start on a group of four (P, S multiples of 4: one Philox call per
    four probabilities) and rows whose groups straddle them (the second draw), on fp32 (16-column) and half
    (32-column, several token tiles) tiles. Seeds: small, negative, a low word with its sign bit set (Triton
    sign-extends it into the key), a high word."""
    B, H, p = 1, 2, 0.3
    n = P + S
    eye = torch.eye(n, dtype=dtype)
    q, k = torch.zeros(B, H, S, n, dtype=dtype), torch.zeros(B, H, S, n, dtype=dtype)
    pk, pv = torch.zeros(H, P, n, dtype=dtype), eye[:P].expand(H, P, n).contiguous()
    v = eye[P:].expand(B, H, S, n).contiguous()
    for seed in (7, -5, 0x8000_0001, (1 << 40) + 3):
        out, _ = fwd_op(q, k, v, pk, pv, None, None, 1.0, p, op_seed(seed))
        assert torch.equal(out != 0, philox_keep_mask(B, H, S, P, p, seed)), seed


def test_launches_and_host_reads_of_a_training_call():
    """What a GPU training step passes (dropout with seed=None, a packed batch with max_seqlen, prompt_index, a
    bias with its gradient, grouped-query heads, causal): the forward is one Triton launch, the backward two, and
    nothing from prefix_attention(...) through both backward launches reads a tensor on the host (HostReads runs
    the code on its CUDA path: device-side checks, the seed drawn and loaded as a tensor)."""
    inputs, cu, L, _ = packed_inputs([5, 1], 2, 1, 2, 16, T=2, bias=(1, 2, 5, 5))
    q, k, v, pk, pv, _, pidx, bias = inputs
    leaves = (q, k, v, pk, pv, bias)

    def call():
        return prefix_attention_varlen(q, k, v, pk, pv, dropout_p=0.1, prompt_index=pidx, attn_bias=bias, causal=True,
                                       cu_seqlens=cu, max_seqlen=L, backend="triton")

    with HostReads() as reads, TritonLaunches() as forward:
        out = call()
    with HostReads() as backward_reads, TritonLaunches() as backward:
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert reads.reads == [] and backward_reads.reads == [], reads.report() + backward_reads.report()
    assert forward.total == 1, forward.counts
    assert backward.total == 2, backward.counts
    assert all(torch.isfinite(g).all() for g in grads)


class _DeviceOps(TorchDispatchMode):
    """Counts the aten ops that would run a kernel on a GPU (allocations and views run none)."""

    METADATA = ("empty", "empty_like", "view", "transpose", "detach", "select", "slice", "expand", "unsqueeze",
                "alias", "as_strided", "_unsafe_view", "t", "permute", "squeeze")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.METADATA:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_device_work_around_the_launches(monkeypatch, dtype):
    """What a call launches besides its Triton kernels (stubbed out here), as a later layer of a training step makes
    it (packed with prompt ids, dropout with seed=None, the offsets and ids already checked by the first layer):
    the seed's draw in the forward; the fixed-order sum of the prefix gradient's partials over the batch chunks in
    the backward, and its cast to a half-precision prefix's dtype. No dummy tensors, no conversions."""
    class Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"):
        monkeypatch.setattr(kernels, name, Stub())
    monkeypatch.setattr(kernels, "interpreting", lambda: False)  # no poisoned outputs
    inputs, cu, L, _ = packed_inputs([5, 3], 2, 1, 2, 16, T=2, dtype=dtype)
    q, k, v, pk, pv, _, pidx, _ = inputs
    cu = cu.long()
    kw = dict(dropout_p=0.1, prompt_index=pidx, causal=True, cu_seqlens=cu, max_seqlen=L, backend="triton")
    with sync_free():
        prefix_attention(q, k, v, pk, pv, **kw)  # the first layer checks the offsets and prompt ids
        with _DeviceOps() as forward:
            out = prefix_attention(q, k, v, pk, pv, **kw)
        dout = torch.ones_like(out)
        with _DeviceOps() as backward:
            torch.autograd.grad(out, (q, k, v, pk, pv), dout)
    assert forward.ops == ["randint"], forward.ops
    assert backward.ops == ["sum"] + (["_to_copy"] if dtype != torch.float32 else []), backward.ops


def test_device_side_checks_run_once_per_tensor_until_it_changes():
    """On the CUDA path the offsets' check (asynchronous asserts) runs for the first layer's call only: later calls
    with the same, unchanged tensor skip it; an in-place change (a new version) is checked again."""
    q = torch.zeros(1, 1, 5, 16)
    pk = torch.zeros(1, 2, 16)
    cu = torch.tensor([0, 2, 5])
    call = lambda: prefix_attention_varlen(q, q, q, pk, pk, scale=1.0, cu_seqlens=cu, max_seqlen=3,  # noqa: E731
                                           backend="triton")
    with sync_free():
        with _DeviceOps() as first:
            call()
        with _DeviceOps() as second:
            call()
        assert "_assert_async" in first.ops and "_assert_async" not in second.ops
        cu[2] = 9  # in place: past the 5 packed rows
        with pytest.raises(RuntimeError, match="cu_seqlens must rise from 0"):
            call()


def test_a_missing_max_seqlen_is_refused_under_compile(monkeypatch):
    """Finding max_seqlen reads the offsets on the host: the Triton path refuses to under torch.compile (and CUDA
    graph capture); eagerly on the CPU it reads them (tested above)."""
    cu = torch.tensor([0, 2, 5])
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(ValueError, match="needs max_seqlen under torch.compile"):
        attention._check_packed(cu, 5, None, None, triton=True)
    assert attention._check_packed(cu, 5, 3, None, triton=True) == 3


def test_launch_config_overrides_and_tuned_table(monkeypatch):
    """The tuner's hooks: the candidates of a shape class (the default first), a launch with an explicit config
    (here other tiles than the default: the same results), and a GPU's tuned table, which a launch on that GPU
    takes (only from an entry of the same head dim)."""
    sc = kernels.shape_class(9, 3, 16, torch.float32, True)
    assert sc == kernels.ShapeClass("fp32", 32, 32, 16, True, False)
    for kernel in kernels.KERNELS:
        space = kernels.tune_space(kernel, sc)
        assert space[0] == kernels.config_for(kernel, sc) and len(space) > 1
        assert all(c not in space[i + 1:] for i, c in enumerate(space))
    q, k, v, pk, pv, mask, pidx, _ = make_inputs(2, 2, 1, 9, 3, 16, T=2, pad="right")
    kw = dict(scale=0.25, dropout_p=0.2, seed=5, causal=True)
    want = kernels.forward(q, k, v, pk, pv, mask, pidx, **kw)
    other = LaunchConfig(dict(BLOCK_M=32, BLOCK_N=16, BLOCK_P=16, BLOCK_D=32), num_warps=4)
    got = kernels.forward(q, k, v, pk, pv, mask, pidx, config=other, **kw)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    dout = torch.randn(want[0].shape, generator=torch.Generator().manual_seed(2))
    args = (dout, q, k, v, pk, pv, *want, mask, pidx)
    want_grads = kernels.backward(*args, **kw)
    got_grads = kernels.backward(*args, configs={"bwd_dq": other, "bwd_dkdv": other.with_tiles(BLOCK_M=16)}, **kw)
    for a, b in zip(got_grads[:5], want_grads[:5]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    from fastprompt.kernels import tuning

    entry = tuning.TunedEntry("prefix_attention", "fwd", dataclasses.asdict(sc),
                              {**other.tiles, "num_warps": 4, "num_stages": 3}, 0.1)
    monkeypatch.setattr(tuning, "tuned_entry", lambda op, kernel, key, device: entry if kernel == "fwd" else None)
    monkeypatch.setattr(kernels, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    plan = kernels._plan(("fwd",), 2, 2, 1, 9, 3, 16, 1, torch.float32, True, False, "ieee", True, False, False,
                         False, True, True, cuda)
    assert {k: plan.consts["fwd"][k] for k in other.tiles} == other.tiles
    assert plan.opts["fwd"] == dict(num_warps=4, num_stages=3, maxnreg=None)  # a bound not in the entry: none
    assert kernels.tuned_config("fwd", sc, torch.device("cpu")) is None  # tables are per GPU model
    assert kernels.tuned_config("fwd", dataclasses.replace(sc, head_dim=64), cuda) is None  # another head dim
    kernels._plan.cache_clear()


# ------------------------------------------------------------------------------------------------
# torch.library registration


def test_opcheck_with_every_switch():
    packed, cu, L, _ = packed_inputs([3, 1, 4], 4, 2, 2, 16, T=2, bias=(1, 4, 5, 5), L=5)
    q, k, v, pk, pv, _, pidx, bias = packed
    padded = make_inputs(2, 2, 1, 5, 1, 16, pad="left", bias=(2, 1, 5, 5))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    for args, kwargs in (
        ((q, k, v, pk, pv, None, pidx, 0.3, 0.2, op_seed(7)),
         dict(attn_bias=bias, cu_seqlens=cu, max_seqlen=L, causal=True)),
        ((*padded[:7], 0.25, 0.0, op_seed(0)), dict(attn_bias=padded[7], causal=True, window_left=2, window_right=0)),
    ):
        torch.library.opcheck(fwd_op.default, args, kwargs, test_utils=utils)


def test_fake_tensor_propagation_packed_and_bias_gradient():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 10, 4, 16).transpose(1, 2)  # 10 packed rows, 4 query heads
        kv = torch.empty(1, 10, 2, 16).transpose(1, 2)  # 2 key/value heads
        pk = torch.empty(3, 2, 5, 16)
        cu, pidx, bias = torch.tensor([0, 4, 10]), torch.tensor([0, 2]), torch.empty(1, 4, 6, 6)
        out, lse = fwd_op(q, kv, kv, pk, pk, None, pidx, 0.25, 0.1, op_seed(0), bias, cu, 6, True, -1, -1)
        assert out.shape == (1, 4, 10, 16) and out.transpose(1, 2).is_contiguous()
        assert lse.shape == (1, 4, 10) and lse.dtype == torch.float32
        grads = torch.ops.fastprompt.prefix_attention_bwd(out, q, kv, kv, pk, pk, out, lse, None, pidx, 0.25, 0.1,
                                                          op_seed(0),
                                                          bias, cu, 6, True, -1, -1, True)
        assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape, pk.shape, pk.shape, bias.shape]


def test_torch_compile_keeps_one_node_with_every_switch():
    """Packed rows, grouped-query heads, causal, a bias with its gradient, dropout: one opaque node of a captured
    graph, and the same values and gradients through AOTAutograd as eagerly."""
    inputs, cu, L, _ = packed_inputs([3, 1, 4], 2, 1, 2, 16, T=2, bias=(1, 2, 4, 4))
    q, k, v, pk, pv, _, pidx, bias = inputs
    leaves = (q, k, v, pk, pv, bias)

    def f(q, k, v, pk, pv, bias):
        return _kernel_attention("triton", q, k, v, pk, pv, None, pidx, 0.25, 0.1, 3, causal=True, attn_bias=bias,
                                 cu_seqlens=cu, max_seqlen=L).square().sum()

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    want = f(*leaves)
    want_grads = torch.autograd.grad(want, leaves)
    for backend in (capture, "aot_eager"):
        loss = torch.compile(f, backend=backend, fullgraph=True)(*leaves)
        torch.testing.assert_close(loss, want)
        for g, w in zip(torch.autograd.grad(loss, leaves), want_grads):
            torch.testing.assert_close(g, w)
    code = graphs[0].code
    assert code.count("torch.ops.fastprompt.prefix_attention_fwd") == 1 and "matmul" not in code

"""The C++ prefix-attention kernel's grouped-query heads, causal mask, sliding window, additive bias and packed
(variable-length) sequences, against the plain-PyTorch reference (fastprompt.ops.reference, itself checked against
SDPA in test_prefix_attention_reference.py); the aten composite and the "reference" backend with the same
arguments; packed against padded, bit for bit; the public function's validation of the new arguments.

Tolerances. fp32 kernel vs the fp32 reference on the same inputs: |got - want| <= atol + rtol |want| with
rtol = 1e-5 and atol = 1e-5 * max(1, max |want|) over the tensor. The analysis of test_prefix_attention_cpu.py
(scores within a few ulps of |q||k| * scale, exp within 2 ulp, outputs and gradients sums of at most P + S O(1)
terms: differences of a few 1e-7) holds for the outputs, dQ and the per-token dK, dV here too; a bias adds one
rounded addition per score. What is new is longer sums: with grouped-query heads the key/value gradients add the
group's query heads, and the prefix gradients add n = group * rows * examples terms (up to 6 * 70 * 3 = 1260 in
these cases; ~630 per prompt). Two summation orders of n float32 terms differ by about u * sqrt(n) * (the size of
the partial sums), u = 6e-8, and the partial sums are bounded by the tensor's largest entries (|dprefix| <= 30
here), not by the entry itself: an entry that cancels to ~1 carries the error of sums of ~30. Hence an absolute
term scaled by the tensor's largest entry: u * sqrt(630) * 30 = 4.5e-5 expected at most vs an allowed 3e-4
(observed: 1.9e-5, for dprefix_v of the multi-query case). The bias gradient is dS itself (one term) summed over its
broadcast batch (<= 5 terms). A bug (a hidden key seen, a visible one missed, a wrong KV head, row offset or bias
entry) moves entries by O(0.1) of their scale. float64 paths (the aten composite, the reference backend) against
the reference in float64: 1e-12 (sums of <= 1260 terms of O(1) at u = 1.1e-16: ~1e-13 at most). Packed vs padded:
the kernel gives the same bits (a token's tile column and every summation order are the same in both layouts; the
padded layout only adds exact zeros), so that comparison is exact. fp16 inputs: the kernel computes in float32 from
the same rounded values, so only the final rounding to fp16 differs (2^-11 relative): 1e-3.
"""
import pytest
import torch

from fastprompt.backends import TRITON_INSTALLED
from fastprompt.ops import _cpp, attention_cpu, prefix_attention, prefix_attention_varlen
from fastprompt.ops.reference import prefix_attention_reference

pytestmark = pytest.mark.skipif(not _cpp.available(), reason=str(_cpp.missing_reason()))

ATOL = RTOL = 1e-5
NAMES = ("dq", "dk", "dv", "dprefix_k", "dprefix_v", "dbias")


def seed_tensor(value):
    return torch.tensor(value, dtype=torch.int64)


def make(shape_q, Hkv, P, T=None, bias_shape=None, dtype=torch.float32, seed=0):
    """q in transformers' layout ((B, S, H, D) seen as (B, H, S, D); packed B = 1), k, v with Hkv heads, a prefix
    (Hkv, P, D) or (T, Hkv, P, D), a bias of bias_shape (requires grad) or None."""
    g = torch.Generator().manual_seed(seed)
    B, H, S, D = shape_q
    q = torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, S, Hkv, D, generator=g).to(dtype).transpose(1, 2).requires_grad_() for _ in range(2))
    pshape = (Hkv, P, D) if T is None else (T, Hkv, P, D)
    pk, pv = (torch.randn(*pshape, generator=g).to(dtype).requires_grad_() for _ in range(2))
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g).to(dtype).requires_grad_()
    return q, k, v, pk, pv, bias


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def leaves_of(q, k, v, pk, pv, bias):
    return [x for x in (q, k, v, pk, pv, bias) if x is not None]


def grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


def assert_close(name, got, want, atol=ATOL, rtol=RTOL):
    """atol is relative to the tensor's scale (the module docstring's analysis): atol * max(1, max |want|)."""
    assert got.shape == want.shape, f"{name}: {got.shape} vs {want.shape}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.double(), want.double(), atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# cases: padded (B, H, Hkv, S, P, D, T, padding, causal, window, bias, dropout) and packed


PADDED = {
    # grouped-query, causal, right-random padding with an all-padding example, D not a multiple of 16
    "gqa_causal": (2, 4, 2, 37, 5, 48, None, "random", True, (-1, -1), None, 0.0),
    # multi-query, a bias (1, H, S, S), mixed prompts, S over several 16-row bands, dropout
    "mqa_bias_prompts_dropout": (3, 6, 1, 70, 3, 32, 2, "random", True, (-1, -1), "1H", 0.3),
    # window on both sides, P = 0 (rows may see nothing: zeros), a per-example bias (B, 1, S, S)
    "window_no_prefix_bias": (2, 4, 4, 20, 0, 16, None, "random", False, (3, 2), "B1", 0.0),
    # left padding (decoders) with causal: the leading pad rows see the prefix only; odd D, MQA
    "left_padding_causal": (3, 2, 1, 19, 1, 33, None, "left", True, (-1, -1), "BH", 0.2),
    # one token, one prefix row
    "single_token": (2, 2, 2, 1, 1, 7, None, None, True, (-1, -1), "1H", 0.0),
    # causal sliding window over two 64-row blocks' worth of rows, P > 16, dropout
    "causal_sliding_window": (2, 4, 4, 130, 17, 64, None, "random", True, (20, 0), None, 0.3),
    # a right-only window without causal, no padding
    "right_window": (2, 2, 1, 24, 4, 16, 3, None, False, (-1, 4), "11", 0.0),
}

# (lengths, H, Hkv, P, D, T, max_seqlen, causal, window, bias, dropout)
PACKED = {
    "odd_lengths_gqa_bias_dropout": ([1, 5, 3, 17, 1], 4, 2, 3, 16, 2, 20, True, (-1, -1), "B1", 0.3),
    "all_equal": ([8, 8, 8], 3, 3, 16, 32, None, None, False, (-1, -1), None, 0.0),
    # ten sequences: two backward groups of 8 share the prefix gradient slots
    "one_long_many_short": ([70, 1, 1, 2, 1, 3, 1, 1, 1, 1], 2, 1, 2, 24, None, None, True, (5, 0), "1H", 0.2),
    "length_one_no_prefix": ([1, 1, 1], 2, 2, 0, 8, None, None, False, (-1, -1), None, 0.0),
    "empty_sequence": ([3, 0, 5], 2, 1, 4, 16, 2, 6, False, (1, 1), "BH", 0.0),
}


def padded_case(B, H, Hkv, S, P, D, T, padding, causal, window, bias, p, dtype=torch.float32, seed=0):
    bias_shape = None if bias is None else (B if bias[0] == "B" else 1, H if bias[1] == "H" else 1, S, S)
    q, k, v, pk, pv, ab = make((B, H, S, D), Hkv, P, T, bias_shape, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = None
    if padding == "random":
        mask = torch.rand(B, S, generator=g) > 0.3
        mask[0] = False
        mask[-1, 0] = True
    elif padding == "left":
        lengths = torch.randint(1, S + 1, (B,), generator=g)
        mask = torch.arange(S)[None, :] >= (S - lengths)[:, None]
    pidx = None if T is None else torch.arange(B) % T
    kw = dict(key_padding_mask=mask, prompt_index=pidx, causal=causal, window=window, attn_bias=ab)
    return (q, k, v, pk, pv, ab), kw, (B, H, S, P)


def packed_case(lengths, H, Hkv, P, D, T, L, causal, window, bias, p, dtype=torch.float32, seed=0):
    B, N = len(lengths), sum(lengths)
    width = L or max(lengths)
    bias_shape = None if bias is None else (B if bias[0] == "B" else 1, H if bias[1] == "H" else 1, width, width)
    q, k, v, pk, pv, ab = make((1, H, N, D), Hkv, P, T, bias_shape, dtype, seed)
    pidx = None if T is None else torch.arange(B) % T
    kw = dict(prompt_index=pidx, causal=causal, window=window, attn_bias=ab, cu_seqlens=offsets(lengths),
              max_seqlen=L)
    return (q, k, v, pk, pv, ab), kw, (B, H, width, P)


def run_case(tensors, kw, dims, p, backend="cpu", seed=1234):
    """Output and gradients of the op and of the reference replaying the kernel's dropout mask."""
    leaves = leaves_of(*tensors)
    out = prefix_attention(*tensors[:5], dropout_p=p, seed=seed, backend=backend, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
    got = grads(out, leaves, dout)
    fused = backend == "cpu" and attention_cpu.available(tensors[0])
    keep = attention_cpu.keep_mask(*dims, p, seed) if p and fused else None  # else the seeded-generator mask
    ref_leaves = [x.detach().to(torch.promote_types(x.dtype, torch.float32)).requires_grad_() for x in leaves]
    ref_kw = dict(kw, attn_bias=ref_leaves[5] if tensors[5] is not None else None)
    want, lse = prefix_attention_reference(*ref_leaves[:5], dropout_p=p, seed=seed, dropout_mask=keep,
                                           return_lse=True, **ref_kw)
    return out, got, want, grads(want, ref_leaves, dout.to(want.dtype)), lse


def kernel_lse(tensors, kw, p, seed=1234):
    """The log-sum-exp the raw forward op saves."""
    q, k, v, pk, pv, ab = (None if x is None else x.detach() for x in tensors)
    cu = kw.get("cu_seqlens")
    max_seqlen = kw.get("max_seqlen")
    _, lse = torch.ops.fastprompt.prefix_attention_cpu_fwd(
        q, k, v, pk, pv, kw.get("key_padding_mask"), kw["prompt_index"], q.shape[-1] ** -0.5, p, seed_tensor(seed),
        kw["causal"], kw["window"][0], kw["window"][1], ab, cu, -1 if max_seqlen is None else max_seqlen)
    return lse


def check_against_reference(tensors, kw, dims, p):
    out, got, want, want_grads, want_lse = run_case(tensors, kw, dims, p)
    assert out.shape == tensors[0].shape and out.transpose(1, 2).is_contiguous()  # (B, S, H, D) buffer
    assert_close("out", out, want)
    names = [n for n, x in zip(NAMES, tensors) if x is not None]
    for name, g, w, x in zip(names, got, want_grads, leaves_of(*tensors)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert_close(name, g, w)
    lse = kernel_lse(tensors, kw, p)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "rows that see no key"
    assert_close("lse", lse.masked_fill(torch.isneginf(lse), 0), want_lse.masked_fill(torch.isneginf(want_lse), 0))


# ------------------------------------------------------------------------------------------------
# against the reference, every ISA level


@pytest.mark.parametrize("case", list(PADDED))
def test_padded_matches_reference(case, isa, poisoned):
    *shape, p = PADDED[case]
    tensors, kw, dims = padded_case(*shape, p)
    check_against_reference(tensors, kw, dims, p)


@pytest.mark.parametrize("case", list(PACKED))
def test_packed_matches_reference(case, isa, poisoned):
    *shape, p = PACKED[case]
    tensors, kw, dims = packed_case(*shape, p)
    check_against_reference(tensors, kw, dims, p)


def test_half_inputs_with_the_new_arguments():
    """fp16 q, k, v, prefix and bias are computed in float32: only the final rounding differs (2^-11 relative)."""
    tensors, kw, dims = padded_case(2, 4, 2, 21, 3, 32, None, "left", True, (6, 0), "1H", 0.0, dtype=torch.float16)
    out, got, want, want_grads, _ = run_case(tensors, kw, dims, 0.0)
    assert out.dtype == torch.float16
    assert_close("out", out, want, 1e-3, 1e-3)
    for name, g, w in zip(NAMES, got, want_grads):
        assert g.dtype == torch.float16, name
        assert_close(name, g, w, 1e-3, 1e-3)


def test_grouped_heads_read_their_kv_head():
    """GQA equals multi-head attention over k, v repeated per query head (transformers' repeat_kv), bit for bit in
    the forward: each query head reads its KV head in place, the same values in the same order."""
    tensors, kw, _ = padded_case(2, 6, 2, 17, 3, 16, None, "random", True, (-1, -1), None, 0.0)
    q, k, v, pk, pv, _ = (None if x is None else x.detach() for x in tensors)
    out = prefix_attention(q, k, v, pk, pv, backend="cpu", **kw)
    expand = [x.repeat_interleave(3, dim=-3) for x in (k, v, pk, pv)]
    assert torch.equal(out, prefix_attention(q, *expand, backend="cpu", **kw))


def test_causal_rows_see_only_earlier_tokens_and_the_prefix():
    """Changing token j's key and value changes no output row i < j (causal), and a change to the prefix reaches
    every row."""
    tensors, kw, _ = padded_case(1, 2, 1, 24, 4, 16, None, None, True, (-1, -1), None, 0.0)
    q, k, v, pk, pv, _ = (None if x is None else x.detach() for x in tensors)
    base = prefix_attention(q, k, v, pk, pv, backend="cpu", causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 10] += 1.0
    v2[:, :, 10] += 1.0
    moved = (prefix_attention(q, k2, v2, pk, pv, backend="cpu", causal=True) != base).any(-1)[0, 0]
    assert not moved[:10].any() and moved[10:].all()
    assert (prefix_attention(q, k, v, pk + 1.0, pv, backend="cpu", causal=True) != base).any(-1).all()


# ------------------------------------------------------------------------------------------------
# packed = padded, bit for bit


def pad(x, lengths, L):
    """(1, heads, N, D) packed rows -> (B, heads, L, D) right-padded with zeros."""
    out = x.new_zeros(len(lengths), x.shape[1], L, x.shape[-1])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :, :n] = x[0, :, start:start + n]
        start += n
    return out


def unpad(x, lengths):
    return torch.cat([x[b, :, :n] for b, n in enumerate(lengths)], 1).unsqueeze(0)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_packed_equals_padded_bit_for_bit(p, isa):
    """The same sequences packed (prefix_attention_varlen) and right-padded to max_seqlen (prefix_attention): the
    same output rows, dropout decisions and gradients (the padded rows' output gradient 0), bit for bit. The
    packed form's keywords given to prefix_attention (the spelling before the split) run the varlen entry."""
    lengths, L, H, Hkv, P, D = [3, 1, 9, 20, 5, 2, 6, 1, 11], 24, 4, 2, 3, 16
    (q, k, v, pk, pv, bias), kw, _ = packed_case(lengths, H, Hkv, P, D, 2, L, True, (7, -1), "1H", p)
    leaves = [q, k, v, pk, pv, bias]
    out = prefix_attention_varlen(q, k, v, pk, pv, dropout_p=p, seed=99, backend="cpu", **kw)
    with torch.no_grad():
        assert torch.equal(out, prefix_attention(q, k, v, pk, pv, dropout_p=p, seed=99, backend="cpu", **kw))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    packed_grads = grads(out, leaves, dout)

    padded = [pad(x.detach(), lengths, L).requires_grad_() for x in (q, k, v)]
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    pk2, pv2, bias2 = (x.detach().requires_grad_() for x in (pk, pv, bias))
    out2 = prefix_attention(*padded, pk2, pv2, mask, dropout_p=p, seed=99, backend="cpu",
                            prompt_index=kw["prompt_index"], causal=True, window=(7, -1), attn_bias=bias2)
    padded_grads = grads(out2, [*padded, pk2, pv2, bias2], pad(dout, lengths, L))
    assert torch.equal(out, unpad(out2, lengths))
    for name, a, b in zip(NAMES, packed_grads, padded_grads):
        assert torch.equal(a, unpad(b, lengths) if name in ("dq", "dk", "dv") else b), name


def test_packed_dropout_mask_is_the_padded_mask():
    """Read the packed kernel's dropout decisions back (q = k = 0: every visible key has probability 1/n; one-hot
    values make out[i, c] = keep / (n (1 - p))): they are keep_mask of the padded layout of width L, the mask the
    Triton kernels draw for the same batch right-padded (test_prefix_attention_cpu.py checks that equality)."""
    lengths, L, H, P, p, seed = [5, 1, 7, 3], 9, 2, 3, 0.4, 2024
    B, N, n = len(lengths), sum(lengths), P + L
    zeros = torch.zeros(1, H, N, n)
    eye = torch.eye(n)
    v = torch.cat([eye[P:P + m] for m in lengths])[None, None].expand(1, H, N, n).contiguous()
    pv = eye[:P].expand(H, P, n).contiguous()
    out = prefix_attention_varlen(zeros, zeros, v, torch.zeros(H, P, n), pv, offsets(lengths), L, dropout_p=p,
                                  seed=seed, backend="cpu")
    keep = attention_cpu.keep_mask(B, H, L, P, p, seed)
    start = 0
    for b, m in enumerate(lengths):
        rows = out[0, :, start:start + m]
        torch.testing.assert_close(rows[rows != 0], torch.full_like(rows[rows != 0], 1 / ((P + m) * (1 - p))))
        assert torch.equal(rows[..., :P + m] != 0, keep[b, :, :m, :P + m]), b
        assert not rows[..., P + m:].any()
        start += m


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded_mqa"])
def test_results_do_not_depend_on_the_thread_count(packed):
    """Items are handed out dynamically; the backward's prefix slots are fixed groups of sequences; the forward's
    items are (sequence, KV head), or (sequence, query head) when there are fewer than two per thread (the padded
    multi-query case switches between the two from one thread to two): the same bits either way."""
    if packed:
        tensors, kw, _ = packed_case([30, 2, 1, 17, 9, 4, 1, 1, 12, 6], 4, 2, 3, 16, None, None, True, (-1, -1), "1H",
                                     0.2)
    else:
        tensors, kw, _ = padded_case(3, 4, 1, 21, 3, 16, 2, "random", True, (-1, -1), "B1", 0.2)
    leaves = leaves_of(*tensors)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            out = prefix_attention(*tensors[:5], dropout_p=0.2, seed=5, backend="cpu", **kw)
            results.append((out, *grads(out, leaves, torch.ones_like(out))))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


# ------------------------------------------------------------------------------------------------
# the float64 paths: the aten composite and the reference backend take every argument


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", ["window_no_prefix_bias", "left_padding_causal", "odd_lengths_gqa_bias_dropout",
                                  "empty_sequence"])
def test_float64_paths_match_the_reference(case, backend):
    """float64 stays off the kernel: the composite (SDPA, or eager attention with the seeded mask when there is
    dropout or a bias gradient) and the reference backend give the reference's numbers, dropout included (the same
    seeded generator mask)."""
    if case in PADDED:
        *shape, p = PADDED[case]
        tensors, kw, dims = padded_case(*shape, p, dtype=torch.float64)
    else:
        *shape, p = PACKED[case]
        tensors, kw, dims = packed_case(*shape, p, dtype=torch.float64)
    assert not attention_cpu.available(tensors[0])
    out, got, want, want_grads, _ = run_case(tensors, kw, dims, p, backend=backend)
    assert out.dtype == torch.float64
    assert_close("out", out, want, 1e-12, 1e-12)
    for name, g, w in zip(NAMES, got, want_grads):
        assert_close(name, g, w, 1e-12, 1e-12)


@pytest.mark.skipif(not TRITON_INSTALLED, reason="needs the triton package (its interpreter runs the kernels here)")
def test_public_function_passes_the_new_arguments_to_the_triton_kernels(monkeypatch):
    """backend="triton" gets grouped-query heads, causal, a window, the bias (with its gradient) and a packed batch
    through the public function (the kernels' own tests call the op directly): same results as the reference."""
    from fastprompt.kernels import prefix_attention as kernels

    if not kernels.interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 at import (tests/conftest.py)")
    seen = []
    forward = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda *a, **kw: seen.append(kw) or forward(*a, **kw))
    tensors, kw, dims = packed_case([2, 5], 2, 1, 2, 16, None, 6, True, (2, 0), "B1", 0.0)
    out, got, want, want_grads, _ = run_case(tensors, kw, dims, 0.0, backend="triton")
    assert len(seen) == 1 and seen[0]["causal"] and seen[0]["window"] == (2, 0) and seen[0]["max_seqlen"] == 6
    assert seen[0]["attn_bias"] is not None and seen[0]["cu_seqlens"] is not None
    assert_close("out", out, want)
    for name, g, w in zip(NAMES, got, want_grads):
        assert_close(name, g, w)


def test_composite_without_a_bias_gradient_uses_sdpa_and_agrees():
    """No dropout and a bias that needs no gradient: the composite's SDPA branch (grouped heads via enable_gqa)."""
    tensors, kw, dims = padded_case(2, 4, 2, 13, 2, 8, None, "random", True, (4, 1), "1H", 0.0, dtype=torch.float64)
    q, k, v, pk, pv, bias = tensors
    kw["attn_bias"] = bias.detach()
    out = prefix_attention(q, k, v, pk, pv, backend="cpu", **kw)
    want = prefix_attention_reference(q, k, v, pk, pv, **kw)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    for g, w in zip(grads(out, [q, k, v, pk, pv], torch.ones_like(out)),
                    grads(want, [q, k, v, pk, pv], torch.ones_like(want))):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------------------------
# registration: opcheck, torch.compile


def test_opcheck_with_the_new_arguments():
    """The one fused op with the C++ backend (fastprompt::prefix_attention_fwd's argument order)."""
    fwd = torch.ops.fastprompt.prefix_attention_fwd.default
    (q, k, v, pk, pv, bias), kw, _ = padded_case(2, 4, 2, 6, 2, 16, 2, "random", True, (3, -1), "B1", 0.0)
    (cq, ck, cv, cpk, cpv, cbias), ckw, _ = packed_case([2, 5, 1], 2, 1, 3, 16, None, 6, False, (1, 2), "1H", 0.0)
    for args in ((q, k, v, pk, pv, kw["key_padding_mask"], kw["prompt_index"], 0.25, 0.0, seed_tensor(0), bias, None,
                  0, True, 3, -1, "cpu"),
                 (cq, ck, cv, cpk, cpv, None, None, 0.25, 0.2, seed_tensor(5), cbias, ckw["cu_seqlens"], 6, False, 1,
                  2, "cpu")):
        torch.library.opcheck(fwd, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                                     "test_aot_dispatch_dynamic"))


def test_torch_compile_with_the_new_arguments_is_one_node_without_a_graph_break():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    (q, k, v, pk, pv, bias), kw, _ = packed_case([3, 7, 2], 4, 2, 3, 16, None, 8, True, (4, 0), "1H", 0.1)
    cu = kw["cu_seqlens"]

    def f(q, k, v, pk, pv, bias, cu):
        out = prefix_attention(q, k, v, pk, pv, dropout_p=0.1, seed=11, causal=True, window=(4, 0), attn_bias=bias,
                               cu_seqlens=cu, max_seqlen=8, backend="cpu")
        return out.square().sum()

    leaves = [q, k, v, pk, pv, bias]
    want = f(*leaves, cu)
    want_grads = torch.autograd.grad(want, leaves)
    for backend in (capture, "aot_eager"):
        loss = torch.compile(f, backend=backend, fullgraph=True)(*leaves, cu)
        torch.testing.assert_close(loss, want)
        for g, w in zip(torch.autograd.grad(loss, leaves), want_grads):
            torch.testing.assert_close(g, w)
    code = graphs[0].code
    assert code.count("fastprompt.prefix_attention_fwd") == 1
    assert "softmax" not in code and "matmul" not in code


# ------------------------------------------------------------------------------------------------
# bad input: clear ValueErrors from the public function, checks in the raw op


def bad_call(case):
    """The arguments of one misuse."""
    (q, k, v, pk, pv, bias), kw, _ = padded_case(2, 4, 2, 8, 3, 16, None, "random", False, (-1, -1), "1H", 0.0)
    (cq, ck, cv, cpk, cpv, _), ckw, _ = packed_case([3, 5], 4, 2, 3, 16, None, None, False, (-1, -1), None, 0.0)
    args, kw = [q, k, v, pk, pv], dict(key_padding_mask=kw["key_padding_mask"])
    packed = [cq, ck, cv, cpk, cpv]
    cu = ckw["cu_seqlens"]
    if case == "heads_not_a_multiple":
        args[1] = args[2] = torch.zeros(2, 3, 8, 16)
        args[3] = args[4] = torch.zeros(3, 3, 16)
    elif case == "prefix_per_query_head":
        args[3] = args[4] = torch.zeros(4, 3, 16)
    elif case == "kv_length":
        args[1] = args[2] = torch.zeros(2, 2, 7, 16)
    elif case == "window_below_minus_one":
        kw["window"] = (-2, 0)
    elif case == "window_not_a_pair":
        kw["window"] = 3
    elif case == "causal_not_bool":
        kw["causal"] = "yes"
    elif case == "bias_wrong_size":
        kw["attn_bias"] = torch.zeros(1, 4, 8, 7)
    elif case == "bias_wrong_batch":
        kw["attn_bias"] = torch.zeros(3, 1, 8, 8)
    elif case == "bias_wrong_heads":
        kw["attn_bias"] = torch.zeros(1, 2, 8, 8)
    elif case == "bias_integer":
        kw["attn_bias"] = torch.zeros(1, 1, 8, 8, dtype=torch.long)
    elif case == "bias_3d":
        kw["attn_bias"] = bias[0]
    elif case == "packed_batch_not_one":
        kw = dict(cu_seqlens=torch.tensor([0, 8, 16]))
    elif case == "packed_with_mask":
        args, kw = packed, dict(cu_seqlens=cu, key_padding_mask=torch.ones(1, 8, dtype=torch.bool))
    elif case == "offsets_float":
        args, kw = packed, dict(cu_seqlens=cu.float())
    elif case == "offsets_2d":
        args, kw = packed, dict(cu_seqlens=cu[None])
    elif case == "offsets_not_from_zero":
        args, kw = packed, dict(cu_seqlens=torch.tensor([1, 3, 8]))
    elif case == "offsets_last_not_n":
        args, kw = packed, dict(cu_seqlens=torch.tensor([0, 3, 7]))
    elif case == "offsets_decreasing":
        args, kw = packed, dict(cu_seqlens=torch.tensor([0, 5, 3, 8]))
    elif case == "longer_than_max_seqlen":
        args, kw = packed, dict(cu_seqlens=cu, max_seqlen=4)
    elif case == "max_seqlen_without_offsets":
        kw["max_seqlen"] = 8
    elif case == "max_seqlen_zero":
        args, kw = packed, dict(cu_seqlens=cu, max_seqlen=0)
    elif case == "packed_bias_not_max_seqlen":
        args, kw = packed, dict(cu_seqlens=cu, max_seqlen=6, attn_bias=torch.zeros(1, 4, 5, 5))
    elif case == "packed_bias_not_longest":
        args, kw = packed, dict(cu_seqlens=cu, attn_bias=torch.zeros(1, 4, 6, 6))
    elif case == "packed_prompt_index_per_token":
        args = packed[:3] + [torch.zeros(2, 2, 3, 16)] * 2
        kw = dict(cu_seqlens=cu, prompt_index=torch.zeros(8, dtype=torch.long))
    return args, kw


@pytest.mark.parametrize("case, match", [
    ("heads_not_a_multiple", "multiple of k and v's 3 heads"),
    ("prefix_per_query_head", "one prefix per key/value head"),
    ("kv_length", "same \\(B, Hkv, S, D\\) shape"),
    ("window_below_minus_one", "window sizes must be >= 0, or -1"),
    ("window_not_a_pair", "window must be a pair of ints"),
    ("causal_not_bool", "causal must be a bool"),
    ("bias_wrong_size", "attn_bias must be \\(1 or B, 1 or H, S, S\\)"),
    ("bias_wrong_batch", "attn_bias must be"),
    ("bias_wrong_heads", "attn_bias must be"),
    ("bias_integer", "floating-point"),
    ("bias_3d", "attn_bias must be"),
    ("packed_batch_not_one", "\\(1, H, N, D\\)"),
    ("packed_with_mask", "key_padding_mask must be None"),
    ("offsets_float", "int32/int64"),
    ("offsets_2d", "\\(B \\+ 1,\\)"),
    ("offsets_not_from_zero", "from 0 to the N = 8"),
    ("offsets_last_not_n", "from 0 to the N = 8"),
    ("offsets_decreasing", "non-decreasing"),
    ("longer_than_max_seqlen", "sequence 1 has 5 tokens, more than max_seqlen = 4"),
    ("max_seqlen_without_offsets", "only meaningful with cu_seqlens"),
    ("max_seqlen_zero", "positive int"),
    ("packed_bias_not_max_seqlen", "L \\(max_seqlen\\)"),
    ("packed_bias_not_longest", "L = 5"),
    ("packed_prompt_index_per_token", "shape \\(2,\\) \\(one per sequence\\)"),
])
def test_bad_new_arguments_raise_value_error(case, match):
    args, kw = bad_call(case)
    with pytest.raises(ValueError, match=match):
        prefix_attention(*args, **kw)


def test_raw_op_checks_the_offsets_and_the_bias():
    """The raw op guards what it indexes with (the public function's errors come first)."""
    (q, k, v, pk, pv, _), kw, _ = packed_case([3, 5], 2, 1, 2, 16, None, None, False, (-1, -1), None, 0.0)
    args = [x.detach() for x in (q, k, v, pk, pv)]

    def call(cu, bias=None, max_seqlen=-1, left=-1):
        torch.ops.fastprompt.prefix_attention_cpu_fwd(*args, None, None, 0.25, 0.0, seed_tensor(0), False, left, -1,
                                                      bias, cu, max_seqlen)

    with pytest.raises(RuntimeError, match="non-decreasing"):
        call(torch.tensor([0, 6, 5, 8]))
    with pytest.raises(RuntimeError, match="from 0 to N"):
        call(torch.tensor([0, 3, 9]))
    with pytest.raises(RuntimeError, match="longer than max_seqlen"):
        call(kw["cu_seqlens"], max_seqlen=4)
    with pytest.raises(RuntimeError, match="attn_bias must be"):
        call(kw["cu_seqlens"], bias=torch.zeros(1, 1, 4, 4))
    with pytest.raises(RuntimeError, match="window sizes"):
        call(kw["cu_seqlens"], left=-3)
    with pytest.raises(RuntimeError, match="int64"):
        call(kw["cu_seqlens"].int())

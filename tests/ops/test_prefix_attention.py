"""fastprompt.ops.prefix_attention (fastprompt/ops/attention.py): the Triton kernels (under the interpreter) and
the CPU path against the plain-PyTorch reference on the explicit concatenation; dropout contract; custom-op
registration.

Grids are kept tiny: every Triton program instance costs ~20 ms in the interpreter.
"""
import pytest
import torch

from fastprompt.backends import resolve_backend
from fastprompt.ops import draw_seed, prefix_attention
from fastprompt.ops.reference import prefix_attention_reference

from .prefix_cases import op_seed

fwd_op = torch.ops.fastprompt.prefix_attention_fwd

# (atol, rtol) against the float32 reference evaluated on the same (rounded) inputs.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (2e-2, 2e-2)}

# (B, H, S, P, D, T): S not a multiple of the tile (37, 70 > one 64-row tile), P = 1, D = 48 (padded head
# dim), D = 128, P > 16 (two prefix tiles), and a (T, H, P, D) prefix with mixed prompt_index (T = 3).
SHAPES = [
    (2, 2, 37, 5, 48, None),
    (2, 1, 20, 1, 32, None),
    (3, 2, 16, 3, 64, 3),
    (1, 2, 70, 20, 64, None),
    (2, 1, 33, 17, 128, 2),
]


def make_inputs(B, H, S, P, D, T=None, dtype=torch.float32, seed=0, pad=True):
    """Non-contiguous q/k/v like transformers' ``view(B, S, H, D).transpose(1, 2)``; example 0 all padding."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    shape = (H, P, D) if T is None else (T, H, P, D)
    pk, pv = (torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mask = None
    if pad:
        mask = torch.rand(B, S, generator=g) > 0.3
        mask[0] = False  # a fully padded example: its rows attend to the prefix only
        mask[-1, 0] = True
    pidx = None if T is None else torch.arange(B) % T  # mixed prompts within the batch
    if pidx is not None and B > 2:
        pidx[-1] = 0
    return q, k, v, pk, pv, mask, pidx


def reference_fp32(q, k, v, pk, pv, mask, pidx, dout, **kw):
    """Reference output, log-sum-exp and the five gradients, in float32 on the same input values."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, pk, pv)]
    out, lse = prefix_attention_reference(*leaves, mask, prompt_index=pidx, return_lse=True, **kw)
    grads = torch.autograd.grad(out, leaves, dout.float())
    return out, lse, grads


def run_op(q, k, v, pk, pv, mask, pidx, backend, dout=None, scale=None, dropout_p=0.0, seed=0):
    """Output, log-sum-exp (Triton only; None for the CPU composite), the five gradients, and dout."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if backend == "triton":
        out, lse = fwd_op(q, k, v, pk, pv, mask, pidx, scale, dropout_p, op_seed(seed))
    else:
        out, lse = prefix_attention(q, k, v, pk, pv, mask, scale=scale, dropout_p=dropout_p, seed=seed,
                                    prompt_index=pidx, backend=backend), None
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    grads = torch.autograd.grad(out, (q, k, v, pk, pv), dout)
    return out, lse, grads, dout


def assert_close(name, got, want, dtype):
    atol, rtol = TOL[dtype]
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# forward, log-sum-exp and gradients vs the reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}S{}P{}D{}T{}".format(*s))
@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_matches_reference(backend, shape, dtype):
    B, H, S, P, D, T = shape
    q, k, v, pk, pv, mask, pidx = make_inputs(B, H, S, P, D, T, dtype)
    out, lse, grads, dout = run_op(q, k, v, pk, pv, mask, pidx, backend)
    r_out, r_lse, r_grads = reference_fp32(q, k, v, pk, pv, mask, pidx, dout)
    assert_close("out", out, r_out, dtype)
    for name, g, r, x in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), grads, r_grads, (q, k, v, pk, pv)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(name, g, r, dtype)
    if backend == "triton":
        assert_close("lse", lse, r_lse, torch.float32)
        # layout promises: output is a transposed (B, S, H, D) buffer, gradients keep the inputs' strides
        assert out.transpose(1, 2).is_contiguous()
        assert [g.stride() for g in grads[:3]] == [x.stride() for x in (q, k, v)]


def test_fully_padded_rows_attend_to_the_prefix_only():
    q, k, v, pk, pv, mask, _ = make_inputs(2, 2, 9, 3, 32)
    mask[0] = False
    for backend in ("triton", "cpu", "reference"):
        out = prefix_attention(q, k, v, pk, pv, mask, backend=backend)
        assert torch.isfinite(out).all()
        # example 0 has no real token: softmax over the prefix keys only, computed by hand
        w = torch.softmax(q[0].float() @ pk.float().transpose(-1, -2) * 32 ** -0.5, -1)
        torch.testing.assert_close(out[0].float(), w @ pv.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu", "reference"])
def test_no_prefix_and_no_visible_key_gives_zeros(backend):
    """P = 0 (the lead's layers without a prompt): an all-padding example sees nothing -> zeros, finite grads."""
    q, k, v, pk, pv, mask, _ = make_inputs(2, 1, 10, 0, 32)
    out = prefix_attention(q, k, v, pk, pv, mask, backend=backend)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    r_out, _, r_grads = reference_fp32(q, k, v, pk, pv, mask, None, torch.ones_like(out))
    torch.testing.assert_close(out, r_out, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, r_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_auto_cpu_and_defaults():
    q, k, v, pk, pv, mask, _ = make_inputs(2, 2, 12, 4, 32)
    assert resolve_backend("prefix_attention", q, "auto") == "cpu"
    out = prefix_attention(q, k, v, pk, pv, mask)  # scale defaults to D ** -0.5
    ref = prefix_attention_reference(q, k, v, pk, pv, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out_nomask = prefix_attention(q, k, v, pk, pv, None, scale=0.3, backend="triton")
    torch.testing.assert_close(out_nomask, prefix_attention_reference(q, k, v, pk, pv, scale=0.3),
                               atol=1e-5, rtol=1e-5)
    # integer 0/1 masks (transformers' attention_mask) are accepted
    out_int = prefix_attention(q, k, v, pk, pv, mask.long())
    torch.testing.assert_close(out_int, out)


def test_triton_prefix_gradients_are_deterministic():
    q, k, v, pk, pv, mask, pidx = make_inputs(3, 1, 16, 3, 32, T=2)
    _, _, g1, dout = run_op(q, k, v, pk, pv, mask, pidx, "triton")
    _, _, g2, _ = run_op(q, k, v, pk, pv, mask, pidx, "triton", dout=dout)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# dropout


def triton_keep_mask(B, H, S, P, seed, p):
    """Read back the Triton kernel's keep-mask: with q = 0 every visible key has probability > 0, and one-hot
    values make out[b, h, i, j] = keep[b, h, i, j] / ((P + S) (1 - p))."""
    n = P + S
    eye = torch.eye(n)
    q, k = torch.zeros(B, H, S, n), torch.zeros(B, H, S, n)
    pk, pv = torch.zeros(H, P, n), eye[:P].expand(H, P, n).contiguous()
    v = eye[P:].expand(B, H, S, n).contiguous()
    out, _ = fwd_op(q, k, v, pk, pv, None, None, 1.0, p, op_seed(seed))
    nonzero = out[out != 0]
    torch.testing.assert_close(nonzero, torch.full_like(nonzero, 1.0 / (n * (1 - p))))
    return out != 0


def test_triton_dropout_mask_is_a_function_of_the_seed():
    B, H, S, P, p = 2, 2, 21, 6, 0.3
    m1, m2, m3 = (triton_keep_mask(B, H, S, P, seed, p) for seed in (7, 7, 8))
    assert torch.equal(m1, m2)
    assert (m1 != m3).float().mean() > 0.2  # independent masks differ in ~2p(1-p) = 42% of places
    kept = m1.float().mean().item()
    n = m1.numel()
    assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3, kept
    # 64-bit seeds: the high word matters too
    assert not torch.equal(m1, triton_keep_mask(B, H, S, P, 7 + (1 << 40), p))


@pytest.mark.parametrize("T, S, P", [(None, 13, 6), (2, 12, 4)], ids=["straddling", "aligned-prompts"])
def test_triton_dropout_gradient_uses_the_forward_mask(T, S, P):
    """All three kernels replay the forward's mask: rows whose Philox groups straddle them (P + S = 19) and rows
    that start on a group of four (P + S = 16), the two ways the kernels draw it."""
    B, H, D, p, seed = 2, 2, 32, 0.25, 1234
    keep = triton_keep_mask(B, H, S, P, seed, p)
    q, k, v, pk, pv, mask, pidx = make_inputs(B, H, S, P, D, T)
    out, _, grads, dout = run_op(q, k, v, pk, pv, mask, pidx, "triton", dropout_p=p, seed=seed)
    r_out, _, r_grads = reference_fp32(q, k, v, pk, pv, mask, pidx, dout, dropout_p=p, dropout_mask=keep)
    assert_close("out", out, r_out, torch.float32)
    for name, g, r in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), grads, r_grads):
        assert_close(name, g, r, torch.float32)
    again, _, _, _ = run_op(q, k, v, pk, pv, mask, pidx, "triton", dropout_p=p, seed=seed)
    assert torch.equal(out, again)


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_dropout_seed_contract(backend):
    q, k, v, pk, pv, mask, _ = make_inputs(2, 1, 12, 3, 32)
    run = lambda **kw: prefix_attention(q, k, v, pk, pv, mask, dropout_p=0.4, backend=backend, **kw)  # noqa: E731
    a, b, c = run(seed=3), run(seed=3), run(seed=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # seed=None draws from torch's default generator: restoring its state replays the same dropout
    state = torch.get_rng_state()
    d = run()
    torch.set_rng_state(state)
    e = run()
    assert torch.equal(d, e)
    assert not torch.equal(d, run())
    no_drop = prefix_attention(q, k, v, pk, pv, mask, backend=backend)
    assert not torch.equal(a, no_drop)


def test_cpu_dropout_matches_reference_given_its_mask():
    """The CPU path drops what its keep-mask says (the C++ kernel's, which is the Triton kernels' Philox mask;
    tests/ops/test_prefix_attention_cpu.py checks that mask), so it agrees with the reference replaying it."""
    from fastprompt.ops import attention_cpu

    B, H, S, P, D, p = 3, 2, 15, 4, 32, 0.3
    q, k, v, pk, pv, mask, pidx = make_inputs(B, H, S, P, D, T=2)
    out, _, grads, dout = run_op(q, k, v, pk, pv, mask, pidx, "cpu", dropout_p=p, seed=99)
    keep = attention_cpu.keep_mask(B, H, S, P, p, 99)
    r_out, _, r_grads = reference_fp32(q, k, v, pk, pv, mask, pidx, dout, dropout_p=p, dropout_mask=keep)
    assert_close("out", out, r_out, torch.float32)
    for name, g, r in zip(("dq", "dk", "dv", "dprefix_k", "dprefix_v"), grads, r_grads):
        assert_close(name, g, r, torch.float32)


def test_reference_dropout_mask_keeps_one_minus_p():
    from fastprompt.ops.reference import prefix_attention_dropout_mask

    keep = prefix_attention_dropout_mask(99, (64, 64, 64), 0.3, "cpu")
    assert abs(keep.float().mean().item() - 0.7) < 0.01


def test_draw_seed_uses_torch_generator():
    torch.manual_seed(5)
    a = draw_seed()
    torch.manual_seed(5)
    assert draw_seed() == a
    assert 0 <= a < 2**63


# ------------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "case, match",
    [
        ("q3d", "must be \\(B, H, S, D\\)"),
        ("kshape", "same \\(B, Hkv, S, D\\) shape"),
        ("dtype", "cast the prefix"),
        ("prefix_heads", "prefix_k must be"),
        ("prefix_shapes", "differ in shape"),
        ("no_index", "needs prompt_index"),
        ("index_shared", "only meaningful"),
        ("index_range", "must be in \\[0, 2\\)"),
        ("mask_shape", "key_padding_mask must be"),
        ("mask_float", "bool"),
        ("dropout", "dropout_p must be"),
        ("backend", "backend must be one of"),
        ("triton_d", "head dims"),
        ("int_tensor", "floating point"),
        ("empty", "B, H, S, D >= 1"),
        ("index_range_reference", "must be in \\[0, 2\\)"),
    ],
)
def test_bad_input_raises_value_error(case, match):
    q, k, v, pk, pv, mask, _ = make_inputs(2, 2, 8, 3, 32, pad=True)
    kw = dict(key_padding_mask=mask)
    args = [q, k, v, pk, pv]
    if case == "q3d":
        args[0] = q[0]
    elif case == "kshape":
        args[1] = k[:, :, :5]
    elif case == "dtype":
        args[3] = pk.double()
        args[4] = pv.double()
    elif case == "prefix_heads":
        args[3] = args[4] = torch.zeros(3, 3, 32)
    elif case == "prefix_shapes":
        args[4] = torch.zeros(2, 4, 32)
    elif case == "no_index":
        args[3] = args[4] = torch.zeros(2, 2, 3, 32)
    elif case == "index_shared":
        kw["prompt_index"] = torch.zeros(2, dtype=torch.long)
    elif case == "index_range":
        args[3] = args[4] = torch.zeros(2, 2, 3, 32)
        kw["prompt_index"] = torch.tensor([0, 2])
    elif case == "mask_shape":
        kw["key_padding_mask"] = mask[:, :4]
    elif case == "mask_float":
        kw["key_padding_mask"] = mask.float()
    elif case == "dropout":
        kw["dropout_p"] = 1.0
    elif case == "backend":
        kw["backend"] = "cuda"
    elif case == "triton_d":
        args = [torch.zeros(1, 1, 4, 160) for _ in range(3)] + [torch.zeros(1, 2, 160)] * 2
        kw = dict(backend="triton")
    elif case == "int_tensor":
        args[0] = torch.zeros(2, 2, 8, 32, dtype=torch.long)
    elif case == "empty":
        args[0] = args[1] = args[2] = q[:, :, :0]
        kw = {}
    elif case == "index_range_reference":
        args[3] = args[4] = torch.zeros(2, 2, 3, 32)
        kw.update(prompt_index=torch.tensor([-1, 0]), backend="reference")
    with pytest.raises(ValueError, match=match):
        prefix_attention(*args, **kw)


# ------------------------------------------------------------------------------------------------
# torch.library registration


def test_opcheck():
    q, k, v, pk, pv, mask, pidx = make_inputs(2, 1, 6, 2, 32, T=2)
    for args in ((q, k, v, pk, pv, mask, pidx, 32 ** -0.5, 0.0, op_seed(0)),
                 (q, k, v, pk[0], pv[0], None, None, 0.3, 0.2, op_seed(7))):
        torch.library.opcheck(fwd_op.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_fake_tensor_propagation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(4, 8, 3, 16).transpose(1, 2)
        pk = torch.empty(3, 5, 16)
        mask = torch.ones(4, 8, dtype=torch.bool)
        out, lse = fwd_op(q, q, q, pk, pk, mask, None, 0.25, 0.1, op_seed(0))
        assert out.shape == (4, 3, 8, 16) and out.transpose(1, 2).is_contiguous()
        assert lse.shape == (4, 3, 8) and lse.dtype == torch.float32
        grads = torch.ops.fastprompt.prefix_attention_bwd(out, q, q, q, pk, pk, out, lse, mask, None, 0.25, 0.1,
                                                          op_seed(0))
        assert [g.shape for g in grads] == [q.shape] * 3 + [pk.shape] * 2 + [(0,)]  # no attn_bias: no dbias


def test_torch_compile_treats_the_op_as_one_node():
    """The Triton op (interpreted here) is one opaque node of a captured graph, also through AOTAutograd;
    the CPU composite compiles too."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v, pk, pv, mask, _ = make_inputs(1, 2, 8, 3, 32)

    def f(q, k, v, pk, pv, mask, backend="triton"):
        return prefix_attention(q, k, v, pk, pv, mask, dropout_p=0.1, seed=11, backend=backend).square().sum()

    def check(compiled, backend):
        loss = compiled(q, k, v, pk, pv, mask, backend)
        grads = torch.autograd.grad(loss, (q, k, v, pk, pv))
        want = f(q, k, v, pk, pv, mask, backend)
        want_grads = torch.autograd.grad(want, (q, k, v, pk, pv))
        torch.testing.assert_close(loss, want)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w)

    check(torch.compile(f, backend=capture, fullgraph=True), "triton")
    code = graphs[0].code
    assert code.count("fastprompt.prefix_attention_fwd") == 1
    assert "matmul" not in code and "softmax" not in code  # nothing of the op leaked into the graph
    check(torch.compile(f, backend="aot_eager", fullgraph=True), "triton")  # forward + registered backward
    check(torch.compile(f, backend="aot_eager", fullgraph=True), "cpu")

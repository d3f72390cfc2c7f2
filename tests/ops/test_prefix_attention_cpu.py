"""The fused CPU kernel of prefix attention (csrc/prefix_attention.cpp, the "cpu" backend of the fused op of
fastprompt/ops/attention.py) against the plain-PyTorch reference: output, log-sum-exp and all five gradients, its
dropout mask (the Triton kernels' Philox mask), determinism, layouts, the torch.library registration.

Tolerance, fp32 (atol = rtol = 1e-5), against the reference evaluated in float32 on the same inputs. Both compute
the same sums in different orders: scores are D-term dot products (D <= 128) of unit-normal rows, so their
rounding differs by a few ulps of |q||k| * scale ~ sqrt(D), ~1e-6 absolute at most; a score error d moves a
probability by the relative amount d; the kernel's exp is a polynomial within 2 ulp (1.2e-7 relative). The outputs
and gradients are sums of at most P + S = 147 such products with O(1) values (|v|, |dO| <= ~4), so their
differences stay at a few 1e-7 (observed: <= 1e-6). A real bug (a key missed or seen twice, a wrong mask bit, a
wrong row or head) moves entries by O(0.1). fp16/bf16 inputs are computed in float32 by the kernel: compared with
the reference on the same rounded values, only the final rounding of the output and gradients to the input dtype
differs (2^-11 and 2^-8 relative): 1e-3 and 1e-2.
"""
import pytest
import torch

from fastprompt.ops import _cpp, attention_cpu, prefix_attention
from fastprompt.ops.reference import prefix_attention_reference

from .philox_reference import M32, philox, seed_words

pytestmark = pytest.mark.skipif(not _cpp.available(), reason=str(_cpp.missing_reason()))

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
GRADS = ("dq", "dk", "dv", "dprefix_k", "dprefix_v")

# (B, H, S, P, D, T): D not a multiple of the 16-float vector (48), P = 1, a (T, H, P, D) prefix with mixed
# prompt_index, S over one 64-row block (70) and over two (130), B over one backward group of 8 examples (9), and
# D = 128, P > 16.
SHAPES = [
    (2, 2, 37, 5, 48, None),
    (2, 1, 20, 1, 32, None),
    (3, 2, 16, 3, 64, 3),
    (1, 2, 70, 20, 64, None),
    (9, 1, 33, 17, 128, 2),
    (2, 2, 130, 2, 16, None),
]


def make_inputs(B, H, S, P, D, T=None, dtype=torch.float32, seed=0):
    """transformers' layout (``view(B, S, H, D).transpose(1, 2)``); example 0 all padding, the rest ~70% real."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to(dtype).transpose(1, 2).requires_grad_() for _ in range(3))
    shape = (H, P, D) if T is None else (T, H, P, D)
    pk, pv = (torch.randn(*shape, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[0] = False
    mask[-1, 0] = True
    pidx = None if T is None else torch.arange(B) % T
    return q, k, v, pk, pv, mask, pidx


def run_cpu(q, k, v, pk, pv, mask, pidx, dropout_p=0.0, seed=0, dout=None):
    out = prefix_attention(q, k, v, pk, pv, mask, dropout_p=dropout_p, seed=seed, prompt_index=pidx, backend="cpu")
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    grads = torch.autograd.grad(out, (q, k, v, pk, pv), dout)
    return out, grads, dout


def reference(q, k, v, pk, pv, mask, pidx, dout, dropout_p=0.0, keep=None):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, pk, pv)]
    out, lse = prefix_attention_reference(*leaves, mask, prompt_index=pidx, dropout_p=dropout_p, dropout_mask=keep,
                                          return_lse=True)
    return out, lse, torch.autograd.grad(out, leaves, dout.float())


def seed(value):
    """The C++ ops take the seed as a 0-d int64 tensor."""
    return torch.tensor(value, dtype=torch.int64)


def assert_close(name, got, want, dtype=torch.float32):
    atol, rtol = TOL[dtype]
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------------------------------------
# against the reference


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}H{}S{}P{}D{}T{}".format(*s))
def test_matches_reference(shape, dropout_p, isa, poisoned):
    B, H, S, P, D, T = shape
    q, k, v, pk, pv, mask, pidx = make_inputs(B, H, S, P, D, T)
    out, grads, dout = run_cpu(q, k, v, pk, pv, mask, pidx, dropout_p, seed=1234)
    keep = attention_cpu.keep_mask(B, H, S, P, dropout_p, 1234) if dropout_p else None
    r_out, r_lse, r_grads = reference(q, k, v, pk, pv, mask, pidx, dout, dropout_p, keep)
    assert_close("out", out, r_out)
    for name, g, r, x in zip(GRADS, grads, r_grads, (q, k, v, pk, pv)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(name, g, r)
    # the saved log-sum-exp, read from the op itself
    detached = [x.detach() for x in (q, k, v, pk, pv)]
    _, lse = torch.ops.fastprompt.prefix_attention_cpu_fwd(*detached, mask, pidx, D ** -0.5, dropout_p, seed(1234))
    assert_close("lse", lse, r_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_inputs_are_computed_in_float32(dtype):
    q, k, v, pk, pv, mask, pidx = make_inputs(2, 2, 19, 3, 32, 2, dtype=dtype)
    out, grads, dout = run_cpu(q, k, v, pk, pv, mask, pidx)
    r_out, _, r_grads = reference(q, k, v, pk, pv, mask, pidx, dout)
    assert out.dtype == dtype
    assert_close("out", out, r_out, dtype)
    for name, g, r in zip(GRADS, grads, r_grads):
        assert g.dtype == dtype, name
        assert_close(name, g, r, dtype)


def test_no_prefix_and_an_all_padding_example_give_zeros(poisoned):
    """P = 0: the all-padding example 0 sees no key at all -> zero output, log-sum-exp -inf, zero gradients."""
    q, k, v, pk, pv, mask, _ = make_inputs(2, 2, 10, 0, 32)
    out, grads, dout = run_cpu(q, k, v, pk, pv, mask, None, dropout_p=0.2, seed=3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert all(torch.equal(g[0], torch.zeros_like(g[0])) for g in grads[:3])
    keep = attention_cpu.keep_mask(2, 2, 10, 0, 0.2, 3)
    r_out, r_lse, r_grads = reference(q, k, v, pk, pv, mask, None, dout, 0.2, keep)
    assert_close("out", out, r_out)
    for name, g, r in zip(GRADS[:3], grads, r_grads):
        assert_close(name, g, r)
    _, lse = torch.ops.fastprompt.prefix_attention_cpu_fwd(*(x.detach() for x in (q, k, v, pk, pv)), mask, None,
                                                           0.5, 0.0, seed(0))
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


def test_padding_mask_none_and_integer_masks():
    q, k, v, pk, pv, _, _ = make_inputs(2, 2, 12, 4, 32)
    out, grads, dout = run_cpu(q, k, v, pk, pv, None, None)
    r_out, _, r_grads = reference(q, k, v, pk, pv, None, None, dout)
    assert_close("out", out, r_out)
    for name, g, r in zip(GRADS, grads, r_grads):
        assert_close(name, g, r)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    assert torch.equal(prefix_attention(q, k, v, pk, pv, mask, backend="cpu"),
                       prefix_attention(q, k, v, pk, pv, mask.bool(), backend="cpu"))


# ------------------------------------------------------------------------------------------------
# layouts and what the backward computes


def test_layouts_output_is_a_transposed_buffer_and_gradients_keep_the_input_strides():
    q, k, v, pk, pv, mask, _ = make_inputs(2, 3, 9, 2, 32)
    out, grads, _ = run_cpu(q, k, v, pk, pv, mask, None)
    assert out.transpose(1, 2).is_contiguous()  # the attention function's transpose + reshape is free
    assert [g.stride() for g in grads[:3]] == [x.stride() for x in (q, k, v)]
    assert all(g.is_contiguous() for g in grads[3:])
    # contiguous (B, H, S, D) inputs and a prefix with a non-unit last stride work too
    qc, kc, vc = (x.detach().contiguous().requires_grad_() for x in (q, k, v))
    pkt = pk.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
    out2, grads2, _ = run_cpu(qc, kc, vc, pkt, pv, mask, None)
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)
    for g2, g in zip(grads2, grads):
        torch.testing.assert_close(g2, g, atol=1e-6, rtol=1e-6)


def test_backward_computes_only_the_gradients_asked_for():
    """A frozen first layer: q, k, v need no gradient, only the prefix does (the kernel skips dQ, dK, dV)."""
    q, k, v, pk, pv, mask, _ = make_inputs(3, 2, 11, 3, 32)
    out, grads, dout = run_cpu(q, k, v, pk, pv, mask, None)
    q0, k0, v0 = (x.detach() for x in (q, k, v))
    out0 = prefix_attention(q0, k0, v0, pk, pv, mask, backend="cpu")
    dpk, dpv = torch.autograd.grad(out0, (pk, pv), dout)
    assert torch.equal(out0, out)
    assert torch.equal(dpk, grads[3]) and torch.equal(dpv, grads[4])
    empty = torch.ops.fastprompt.prefix_attention_cpu_bwd(
        dout, q0, k0, v0, pk.detach(), pv.detach(), torch.zeros(3, 2, 11), mask, None, 0.1, 0.0, seed(0), False,
        False, False)
    assert all(t.numel() == 0 for t in empty)


# ------------------------------------------------------------------------------------------------
# dropout and determinism


def test_keep_mask_is_the_triton_kernels_mask():
    """The C++ Philox generator gives the Triton kernels' keep decisions bit for bit (read back from the Triton
    forward under the interpreter: with q = 0 and one-hot values, out[b, h, i, j] = keep / ((P + S)(1 - p)))."""
    pytest.importorskip("triton")
    from fastprompt.backends import TRITON_INSTALLED, triton_interpreting

    if not (TRITON_INSTALLED and triton_interpreting()):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)")
    B, H, S, P, p = 2, 2, 13, 5, 0.3
    n = P + S
    eye = torch.eye(n)
    zeros = torch.zeros(B, H, S, n)
    pvals, vvals = eye[:P].expand(H, P, n).contiguous(), eye[P:].expand(B, H, S, n).contiguous()
    # seeds: small, negative, low word with its sign bit set (Triton sign-extends it), high word set
    for seed in (7, -5, 0x8000_0001, (1 << 40) + 3, (1 << 64) - 2):
        out, _ = torch.ops.fastprompt.prefix_attention_fwd(zeros, zeros, vvals, torch.zeros(H, P, n), pvals, None,
                                                           None, 1.0, p, torch.tensor(attention_cpu.signed_seed(seed)))
        assert torch.equal(out != 0, attention_cpu.keep_mask(B, H, S, P, p, seed)), seed


def test_keep_mask_is_the_documented_philox_decision():
    """Each decision is word e % 4 of Philox at counter (e / 4, b * H + h, seed_hi, 0), e = i * (P + S) + j
    (csrc/philox.h), computed here by the Python Philox of tests/ops/philox_reference.py (written from the paper)."""
    B, H, S, P, p = 2, 3, 5, 3, 0.3
    n = P + S
    for seed in (7, -5, 0x8000_0001, (1 << 40) + 3):
        _, hi, key = seed_words(seed)
        want = torch.empty(B, H, S, n, dtype=torch.bool)
        for b in range(B):
            for h in range(H):
                for i in range(S):
                    for j in range(n):
                        e = (i * n + j) & M32
                        r = philox((e >> 2, b * H + h, hi, 0), key)[e & 3]
                        r = r - (1 << 32) if r >> 31 else r  # as int32
                        x = r if r >= 0 else -r - 1
                        want[b, h, i, j] = float(torch.tensor(x, dtype=torch.float32) * 4.6566127342e-10) >= p
        assert torch.equal(attention_cpu.keep_mask(B, H, S, P, p, seed), want), seed


def test_dropout_is_a_function_of_the_seed():
    B, H, S, P, p = 3, 2, 21, 6, 0.3
    m1, m2, m3 = (attention_cpu.keep_mask(B, H, S, P, p, seed) for seed in (7, 7, 8))
    assert torch.equal(m1, m2)
    assert (m1 != m3).float().mean() > 0.3  # independent masks differ in 2p(1-p) = 42% of places
    kept = m1.float().mean().item()
    assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / m1.numel()) ** 0.5, kept
    assert not torch.equal(m1, attention_cpu.keep_mask(B, H, S, P, p, 7 + (1 << 40)))  # the high word matters
    # the op: same seed -> the same output and gradients, bit for bit; seed=None replays from torch's RNG state
    q, k, v, pk, pv, mask, pidx = make_inputs(B, H, S, P, 32, 2)
    a, ga, dout = run_cpu(q, k, v, pk, pv, mask, pidx, p, seed=11)
    b, gb, _ = run_cpu(q, k, v, pk, pv, mask, pidx, p, seed=11, dout=dout)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert not torch.equal(a, run_cpu(q, k, v, pk, pv, mask, pidx, p, seed=12)[0])
    state = torch.get_rng_state()
    c = prefix_attention(q, k, v, pk, pv, mask, dropout_p=p, prompt_index=pidx, backend="cpu")
    torch.set_rng_state(state)
    assert torch.equal(c, prefix_attention(q, k, v, pk, pv, mask, dropout_p=p, prompt_index=pidx, backend="cpu"))


def test_isa_levels_and_their_choice(monkeypatch):
    """auto (or unset) picks the best supported level; a level the CPU lacks or a typo is a clear error."""
    levels = attention_cpu.isa_levels()
    assert levels[-1] == "baseline" and set(levels) <= {"x86-64-v4", "x86-64-v3", "baseline"}
    monkeypatch.delenv("FASTPROMPT_CPU_ISA", raising=False)
    assert attention_cpu.isa() == levels[0]
    monkeypatch.setenv("FASTPROMPT_CPU_ISA", "auto")
    assert attention_cpu.isa() == levels[0]
    monkeypatch.setenv("FASTPROMPT_CPU_ISA", "avx9000")
    with pytest.raises(RuntimeError, match="not a level of this build"):
        attention_cpu.isa()
    q, k, v, pk, pv, mask, _ = make_inputs(2, 1, 5, 2, 16)
    with pytest.raises(RuntimeError, match="FASTPROMPT_CPU_ISA=avx9000"):
        prefix_attention(q, k, v, pk, pv, mask, backend="cpu")


def test_results_do_not_depend_on_the_thread_count():
    """Items are handed out dynamically, prefix gradients summed over fixed example groups in a fixed order."""
    q, k, v, pk, pv, mask, _ = make_inputs(19, 2, 23, 4, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, g_one, dout = run_cpu(q, k, v, pk, pv, mask, None, 0.2, seed=5)
        torch.set_num_threads(max(2, threads))
        many, g_many, _ = run_cpu(q, k, v, pk, pv, mask, None, 0.2, seed=5, dout=dout)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    for a, b in zip(g_one, g_many):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# registration


def test_opcheck():
    """The op's C++ backend: the one fused op (fastprompt::prefix_attention_fwd, backend="cpu") calls the kernel."""
    q, k, v, pk, pv, mask, pidx = make_inputs(2, 1, 6, 2, 32, T=2)
    fwd = torch.ops.fastprompt.prefix_attention_fwd.default
    for args in ((q, k, v, pk, pv, mask, pidx, 32 ** -0.5, 0.0, seed(0)),
                 (q, k, v, pk[0], pv[0], None, None, 0.3, 0.2, seed(7))):
        torch.library.opcheck(fwd, args, dict(backend="cpu"), test_utils=(
            "test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_torch_compile_keeps_the_kernel_as_one_node():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v, pk, pv, mask, _ = make_inputs(2, 2, 8, 3, 32)

    def f(q, k, v, pk, pv, mask):
        return prefix_attention(q, k, v, pk, pv, mask, dropout_p=0.1, seed=11, backend="cpu").square().sum()

    want = f(q, k, v, pk, pv, mask)
    want_grads = torch.autograd.grad(want, (q, k, v, pk, pv))
    for backend in (capture, "aot_eager"):
        loss = torch.compile(f, backend=backend, fullgraph=True)(q, k, v, pk, pv, mask)
        grads = torch.autograd.grad(loss, (q, k, v, pk, pv))
        torch.testing.assert_close(loss, want)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w)
    code = graphs[0].code
    assert code.count("fastprompt.prefix_attention_fwd") == 1
    assert "softmax" not in code and "matmul" not in code and "cat" not in code


def test_compile_draws_the_seed_inside_the_graph():
    """seed=None with dropout: the seed is drawn as a tensor (no .item()), so fullgraph compilation works, and
    under aot_eager the draw consumes torch's generator exactly as eager does (the same output)."""
    q, k, v, pk, pv, mask, _ = make_inputs(2, 2, 8, 3, 32)

    def f(q, k, v, pk, pv, mask):
        return prefix_attention(q, k, v, pk, pv, mask, dropout_p=0.2, backend="cpu")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    state = torch.get_rng_state()
    want = f(q, k, v, pk, pv, mask)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    got = compiled(q, k, v, pk, pv, mask)
    assert torch.equal(got, want)
    assert torch.equal(torch.get_rng_state(), after)


def test_float64_stays_on_the_aten_composite():
    q, k, v, pk, pv, mask, _ = make_inputs(2, 1, 7, 2, 16, dtype=torch.float64)
    assert not attention_cpu.available(q)
    out = prefix_attention(q, k, v, pk, pv, mask, backend="cpu")
    torch.testing.assert_close(out, prefix_attention_reference(q, k, v, pk, pv, mask), atol=1e-12, rtol=1e-12)


def test_raw_op_rejects_what_the_kernel_does_not_take():
    q, k, v, pk, pv, mask, _ = make_inputs(1, 1, 4, 2, 16)
    args = [x.detach() for x in (q, k, v, pk, pv)]
    with pytest.raises(RuntimeError, match="float32 CPU tensors"):
        torch.ops.fastprompt.prefix_attention_cpu_fwd(*[a.double() for a in args], mask, None, 0.25, 0.0, seed(0))
    with pytest.raises(RuntimeError, match="prompt_index out of range"):
        torch.ops.fastprompt.prefix_attention_cpu_fwd(*args[:3], pk.detach()[None], pv.detach()[None], mask,
                                                      torch.tensor([1]), 0.25, 0.0, seed(0))
    with pytest.raises(RuntimeError, match="seed must be"):
        torch.ops.fastprompt.prefix_attention_cpu_fwd(*args, mask, None, 0.25, 0.0, torch.tensor(1.0))

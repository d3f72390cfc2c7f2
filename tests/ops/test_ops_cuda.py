"""The compiled Triton kernels on a CUDA GPU against the plain-PyTorch references (the GPU validation kit's test
subset: ``bash scripts/gpu_check.sh``, or ``TRITON_INTERPRET=0 pytest -m cuda``).

Every test here is marked ``cuda``; tests/conftest.py skips them, with the reason, where there is no CUDA GPU or
where the Triton interpreter is on (the normal test command sets TRITON_INTERPRET=1 for the CPU tests).

Tolerances (atol = rtol), against the reference evaluated in float32 on the same rounded inputs:
- fp32, 1e-5: the kernels multiply in IEEE fp32 (``input_precision="ieee"``; TF32 only if the user enabled it
  for matmuls, which the kit does not) and accumulate in fp32; the only difference to the reference is the
  summation order over at most P + S = 90 keys (or 40 columns), a few ulps (~1e-7 relative) of O(1) values.
- fp16, 1e-3: products of fp16 inputs are exact in the fp32 accumulator; what differs is that probabilities
  and gradient tiles are rounded to fp16 (unit roundoff 2^-11 = 4.9e-4) before the second product, and the
  outputs and gradients are rounded to fp16 (another 4.9e-4 relative): ~1e-3 in the worst element.
- bf16: the same two roundings at 2^-8 = 3.9e-3 each (attention: 2e-2, as under the interpreter; the loss,
  whose inputs are reduced to cosines in fp32 first, 8e-3).
- the loss's fp32 inputs on TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32): each operand rounded to 10
  mantissa bits (u = 2^-11), a cosine of unit vectors off by at most 2u, a logit by 2u/τ: at τ = 0.05 2e-2 (the
  worst case; random inputs come out far below it), the tolerance of :func:`test_contrastive_loss_tf32`.
These are the tolerances the same kernels meet under the CPU interpreter (tests/ops/test_prefix_attention.py,
test_contrastive_loss_triton.py), where the arithmetic is emulated with the same roundings.
"""
import pytest
import torch

from fastprompt.backends import resolve_backend
from fastprompt.ops import contrastive_loss, prefix_attention, prefix_attention_varlen
from fastprompt.ops.attention import _kernel_attention
from fastprompt.ops.reference import prefix_attention_reference

from .prefix_cases import make_inputs, pack, packed_inputs

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2e-2}
LOSS_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
LOSS_BACKENDS = ["triton", "chunked"]
GRAD_NAMES = ("dq", "dk", "dv", "dprefix_k", "dprefix_v")

# (B, H, S, P, D, T): partial tiles (S = 37, 70, 129), P = 1, P > 16, D = 48 / 128, a (T, H, P, D) prefix
# picked per example by prompt_index, and a BERT-base-like point.
ATTN_SHAPES = [
    (2, 2, 37, 5, 48, None),
    (2, 1, 20, 1, 32, None),
    (3, 2, 16, 3, 64, 3),
    (1, 2, 70, 20, 64, None),
    (2, 1, 33, 17, 128, 2),
    (8, 12, 129, 16, 64, None),
]


def attn_inputs(B, H, S, P, D, T=None, dtype=torch.float32, seed=0):
    """q/k/v laid out like transformers' ``view(B, S, H, D).transpose(1, 2)``; example 0 is all padding."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, H, D, generator=g).to("cuda", dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    shape = (H, P, D) if T is None else (T, H, P, D)
    pk, pv = (torch.randn(*shape, generator=g).to("cuda", dtype).requires_grad_() for _ in range(2))
    mask = torch.rand(B, S, generator=g) > 0.3
    mask[0] = False
    mask[-1, 0] = True
    pidx = None if T is None else (torch.arange(B) % T).cuda()
    return q, k, v, pk, pv, mask.cuda(), pidx


def attn_run(q, k, v, pk, pv, mask, pidx, dout=None, **kw):
    out = prefix_attention(q, k, v, pk, pv, mask, prompt_index=pidx, backend="triton", **kw)
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to("cuda", q.dtype)
    return out, torch.autograd.grad(out, (q, k, v, pk, pv), dout), dout


def attn_reference(q, k, v, pk, pv, mask, pidx, dout, **kw):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, pk, pv)]
    out = prefix_attention_reference(*leaves, mask, prompt_index=pidx, **kw)
    return out, torch.autograd.grad(out, leaves, dout.float())


def close(name, got, want, tol):
    """|got - want| <= tol * (|want| + max(1, max |want|)): a rounding error is relative to the largest terms
    that were summed, which are of the order of the largest entry, not of each (possibly cancelled) entry."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    atol = tol * max(1.0, want.abs().max().item()) if want.numel() else tol
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=tol, msg=lambda m: f"{name}: {m}")


def keep_mask(B, H, S, P, seed, p):
    """Read back the kernel's dropout keep-mask: with q = 0 every visible key has probability 1 / (P + S), and
    one-hot values make out[b, h, i, j] = keep[b, h, i, j] / ((P + S)(1 - p))."""
    n = P + S
    eye = torch.eye(n, device="cuda")
    q, k = torch.zeros(B, H, S, n, device="cuda"), torch.zeros(B, H, S, n, device="cuda")
    pk, pv = torch.zeros(H, P, n, device="cuda"), eye[:P].expand(H, P, n).contiguous()
    v = eye[P:].expand(B, H, S, n).contiguous()
    out = prefix_attention(q, k, v, pk, pv, None, scale=1.0, dropout_p=p, seed=seed, backend="triton")
    kept = out[out != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1.0 / (n * (1 - p))))
    return out != 0


# ------------------------------------------------------------------------------------------------ attention


def test_auto_backends_pick_triton_on_cuda():
    q = torch.zeros(1, 1, 4, 64, device="cuda")
    assert resolve_backend("prefix_attention", q, "auto") == "triton"
    z = torch.randn(4, 8, device="cuda")
    assert resolve_backend("contrastive_loss", z, "auto") == "triton"
    ref = contrastive_loss(z, z.flip(0), backend="reference")
    torch.testing.assert_close(contrastive_loss(z, z.flip(0)), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "B{}H{}S{}P{}D{}T{}".format(*s))
def test_prefix_attention_matches_reference(shape, dtype):
    q, k, v, pk, pv, mask, pidx = attn_inputs(*shape, dtype=dtype)
    out, grads, dout = attn_run(q, k, v, pk, pv, mask, pidx)
    r_out, r_grads = attn_reference(q, k, v, pk, pv, mask, pidx, dout)
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    close("out", out, r_out, ATTN_TOL[dtype])
    for name, g, r, x in zip(GRAD_NAMES, grads, r_grads, (q, k, v, pk, pv)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        close(name, g, r, ATTN_TOL[dtype])


def test_prefix_attention_mixed_prompts_equal_one_prompt_at_a_time():
    """prompt_index: a batch mixing T = 3 prompts gives each example what its own (H, P, D) prompt gives."""
    q, k, v, pk, pv, mask, _ = attn_inputs(6, 2, 24, 4, 64, T=3)
    pidx = torch.tensor([2, 0, 1, 1, 0, 2], device="cuda")
    out, grads, dout = attn_run(q, k, v, pk, pv, mask, pidx)
    for t in range(3):
        rows = (pidx == t).nonzero().flatten()
        sub = [x.detach()[rows].requires_grad_() for x in (q, k, v)]
        pkt, pvt = (x.detach()[t].requires_grad_() for x in (pk, pv))
        o, g, _ = attn_run(*sub, pkt, pvt, mask[rows], None, dout=dout[rows])
        close(f"out[prompt {t}]", out[rows], o, 1e-5)
        for name, got, want in zip(GRAD_NAMES[:3], grads[:3], g[:3]):
            close(f"{name}[prompt {t}]", got[rows], want, 1e-5)
        # the prompt's gradient sums over its own examples only
        close(f"dprefix_k[{t}]", grads[3][t], g[3], 1e-5)
        close(f"dprefix_v[{t}]", grads[4][t], g[4], 1e-5)


def test_prefix_attention_backward_is_deterministic():
    """Prefix gradients are per-program partial sums reduced in a fixed order: bitwise equal across runs."""
    q, k, v, pk, pv, mask, pidx = attn_inputs(16, 4, 100, 16, 64, T=2)
    _, g1, dout = attn_run(q, k, v, pk, pv, mask, pidx)
    _, g2, _ = attn_run(q, k, v, pk, pv, mask, pidx, dout=dout)
    for name, a, b in zip(GRAD_NAMES, g1, g2):
        assert torch.equal(a, b), name


def test_dropout_mask_is_a_function_of_the_seed():
    B, H, S, P, p = 2, 2, 37, 6, 0.3
    m1, m2, m3 = (keep_mask(B, H, S, P, seed, p) for seed in (7, 7, 8))
    assert torch.equal(m1, m2)
    assert (m1 != m3).float().mean() > 0.2  # independent masks differ in ~2p(1-p) = 42% of places
    kept, n = m1.float().mean().item(), m1.numel()
    assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3, kept
    assert not torch.equal(m1, keep_mask(B, H, S, P, 7 + (1 << 40), p))  # the high word of the seed counts


@pytest.mark.parametrize("T", [None, 2])
def test_dropout_gradient_replays_the_forward_mask(T):
    B, H, S, P, D, p, seed = 2, 2, 37, 6, 32, 0.25, 1234
    keep = keep_mask(B, H, S, P, seed, p)
    q, k, v, pk, pv, mask, pidx = attn_inputs(B, H, S, P, D, T)
    out, grads, dout = attn_run(q, k, v, pk, pv, mask, pidx, dropout_p=p, seed=seed)
    r_out, r_grads = attn_reference(q, k, v, pk, pv, mask, pidx, dout, dropout_p=p, dropout_mask=keep)
    close("out", out, r_out, 1e-5)
    for name, g, r in zip(GRAD_NAMES, grads, r_grads):
        close(name, g, r, 1e-5)
    again, grads2, _ = attn_run(q, k, v, pk, pv, mask, pidx, dout=dout, dropout_p=p, seed=seed)
    assert torch.equal(out, again)
    for name, a, b in zip(GRAD_NAMES, grads, grads2):
        assert torch.equal(a, b), name


def test_dropout_seed_none_replays_from_the_cuda_rng_state():
    """seed=None on CUDA draws the seed on the device from its generator (no host read): restoring the CUDA RNG
    state replays the mask; the CPU generator is not consumed."""
    q, k, v, pk, pv, mask, _ = attn_inputs(2, 2, 20, 3, 32)
    run = lambda: prefix_attention(q, k, v, pk, pv, mask, dropout_p=0.4, backend="triton")  # noqa: E731
    state, cpu_state = torch.cuda.get_rng_state(), torch.get_rng_state()
    a = run()
    assert torch.equal(torch.get_rng_state(), cpu_state)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, run())
    assert not torch.equal(a, run())


def test_prefix_attention_captures_into_a_cuda_graph():
    """Forward and backward of a packed batch (max_seqlen given, prompt_index, seed=None) capture into one CUDA
    graph: without dropout a replay equals the eager result bit for bit; with dropout every replay draws a new
    mask (the seed is drawn and loaded on the device, not baked into the launch)."""
    lengths = [3, 40, 1, 17]
    inputs, cu, L, _ = packed_inputs(lengths, 4, 2, 16, 64, T=2, dtype=torch.bfloat16, device="cuda")
    q, k, v, pk, pv, _, pidx, _ = inputs
    leaves = (q, k, v, pk, pv)
    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype)

    def step(p):
        out = prefix_attention_varlen(q, k, v, pk, pv, dropout_p=p, prompt_index=pidx, causal=True, cu_seqlens=cu,
                                      max_seqlen=L, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, dout))

    for p in (0.0, 0.2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up: compile the kernels, build the launch plans
            eager = step(p)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step(p)
        graph.replay()
        first = [x.clone() for x in static]
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.isfinite(x).all() for x in static)
        if p == 0:
            for name, a, b, c in zip(("out",) + GRAD_NAMES, eager, first, static):
                assert torch.equal(a, b) and torch.equal(b, c), name
        else:
            assert not torch.equal(first[0], static[0])  # a new mask per replay


def test_encoder_attention_path_matches_the_cache_path(tiny_bert_dir):
    """The prompted encoder on CUDA: fused Triton attention vs the DynamicCache reference, dropout off."""
    from fastprompt.model import PromptConfig, PromptEncoder

    torch.manual_seed(0)
    enc = {mode: PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=5),
                                               prefix_mode=mode).cuda().eval() for mode in ("attention", "cache")}
    enc["cache"].load_state_dict(enc["attention"].state_dict())
    batch = {k: v.cuda() for k, v in enc["attention"].tokenize(["a man plays the guitar", "the dog"]).items()}
    outs, grads = {}, {}
    for mode, e in enc.items():
        outs[mode] = e(**batch)
        grads[mode] = torch.autograd.grad(outs[mode].square().sum(), e.prompt.prefix)[0]
    close("embeddings", outs["attention"], outs["cache"], 1e-5)
    close("prefix gradient", grads["attention"], grads["cache"], 1e-4)


# ------------------------------------------------------------------------ attention: heads, masks, bias, packed
# Grouped-query heads, causal and sliding-window token blocks, an attention bias and packed rows, through the
# "triton" branch of prefix_attention (_kernel_attention), on 64-row tiles: several row and key tiles, tiles the
# window skips, partial ones.

# (B, H, Hkv, S, P, D, T, pad, causal, window, bias shape or None)
SWITCH_CASES = {
    "llama-gqa4-causal-leftpad": (2, 8, 2, 129, 16, 64, None, "left", True, (-1, -1), None),
    "mqa-sliding-prompts": (3, 4, 1, 70, 5, 48, 2, "right", True, (16, -1), None),
    "mpnet-bias-D128": (2, 4, 4, 100, 3, 128, None, "right", False, (-1, -1), (2, 4, 100, 100)),
    "window-bias-broadcast": (2, 6, 3, 37, 1, 32, None, "right", False, (7, 9), (1, 6, 37, 37)),
    "P0-causal-bias": (1, 2, 2, 200, 0, 64, None, None, True, (-1, -1), (1, 1, 200, 200)),
}
SWITCH_GRADS = GRAD_NAMES + ("dattn_bias",)


def switch_run(q, k, v, pk, pv, mask, pidx, bias, dout=None, dropout_p=0.0, seed=0, **kw):
    out = _kernel_attention("triton", q, k, v, pk, pv, mask, pidx, q.shape[-1] ** -0.5, dropout_p, seed, attn_bias=bias,
                            **kw)
    if dout is None:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to("cuda", q.dtype)
    leaves = [q, k, v, pk, pv] + ([bias] if bias is not None else [])
    return out, torch.autograd.grad(out, leaves, dout), dout


def switch_reference(q, k, v, pk, pv, mask, pidx, bias, dout, **kw):
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v, pk, pv) + ((bias,) if bias is not None else ())]
    out = prefix_attention_reference(*leaves[:5], mask, prompt_index=pidx, attn_bias=leaves[5] if bias is not None
                                     else None, **kw)
    return out, torch.autograd.grad(out, leaves, dout.float())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SWITCH_CASES, ids=str)
def test_prefix_attention_heads_masks_bias_match_reference(case, dtype):
    B, H, Hkv, S, P, D, T, pad, causal, window, bias = SWITCH_CASES[case]
    inputs = make_inputs(B, H, Hkv, S, P, D, T, dtype, pad=pad, bias=bias, device="cuda")
    out, grads, dout = switch_run(*inputs, causal=causal, window=window)
    r_out, r_grads = switch_reference(*inputs, dout, causal=causal, window=window)
    close("out", out, r_out, ATTN_TOL[dtype])
    for name, g, r, x in zip(SWITCH_GRADS, grads, r_grads, inputs[:5] + inputs[7:]):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        close(name, g, r, ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefix_attention_packed_matches_reference(dtype):
    """Variable-length rows: one long and many short sequences, length 1 included, grouped-query heads, mixed
    prompts, causal, a bias over in-sequence positions."""
    lengths = [1, 128, 37, 64, 200, 5, 1]
    inputs, cu, L, _ = packed_inputs(lengths, 8, 2, 16, 64, T=2, dtype=dtype, bias=(1, 8, 200, 200), device="cuda")
    kw = dict(causal=True, cu_seqlens=cu, max_seqlen=L)
    out, grads, dout = switch_run(*inputs, **kw)
    r_out, r_grads = switch_reference(*inputs, dout, **kw)
    close("out", out, r_out, ATTN_TOL[dtype])
    for name, g, r in zip(SWITCH_GRADS, grads, r_grads):
        close(name, g, r, ATTN_TOL[dtype])


def test_prefix_attention_packed_equals_padded_with_dropout():
    """The same sequences packed and right-padded drop the same probabilities (the dropout counter counts rows
    from each sequence's start and columns of [prefix ; L tokens]) and give the same output and gradients."""
    lengths, H = [3, 70, 1, 64, 129], 4
    packed, cu, L, padded = packed_inputs(lengths, H, 2, 5, 32, T=2, bias=(len(lengths), H, 129, 129),
                                          device="cuda")
    kw = dict(causal=True, window=(40, -1), dropout_p=0.2, seed=99)
    out, grads, dout = switch_run(*packed, cu_seqlens=cu, max_seqlen=L, **kw)
    pad_dout = torch.zeros(len(lengths), H, L, 32, device="cuda")
    for b, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        pad_dout[b, :, :n] = dout[0, :, start:start + n]
    p_out, p_grads, _ = switch_run(*padded, dout=pad_dout, **kw)
    close("out", out, pack(p_out, lengths), 1e-5)
    for name, g, r in zip(SWITCH_GRADS, grads, p_grads):
        close(name, g, pack(r, lengths) if name in ("dq", "dk", "dv") else r, 1e-5)


def test_prefix_attention_dropout_with_every_switch_replays_the_forward_mask():
    """Grouped-query heads, a sliding causal window, a bias and mixed prompts with dropout: forward and every
    gradient against the reference given the kernels' own mask (it depends on (b, query head, row, column) only,
    so the plain layout reads it back)."""
    B, H, S, P, p, seed = 2, 4, 70, 6, 0.25, 4321
    keep = keep_mask(B, H, S, P, seed, p)
    inputs = make_inputs(B, H, 2, S, P, 32, T=2, pad="right", bias=(1, H, S, S), device="cuda")
    kw = dict(causal=True, window=(20, -1))
    out, grads, dout = switch_run(*inputs, dropout_p=p, seed=seed, **kw)
    r_out, r_grads = switch_reference(*inputs, dout, dropout_p=p, dropout_mask=keep, **kw)
    close("out", out, r_out, 1e-5)
    for name, g, r in zip(SWITCH_GRADS, grads, r_grads):
        close(name, g, r, 1e-5)


# ------------------------------------------------------------------------------------------------ loss

LOSS_CASES = [
    # n, m2, d, z3, offset, options
    (1, 1, 5, True, 0, dict(hinge_weight=1.0)),
    (17, 40, 33, True, 9, dict(symmetric=True, hinge_weight=10.0, hard_negative_weight=0.5, reduction="none")),
    (33, 33, 70, True, 0, dict(hinge_weight=10.0, hard_negative_weight=-0.3)),
    (5, 37, 100, False, 32, dict(reduction="sum", hinge_weight=2.0, hinge_margin=0.6)),
    (300, 300, 384, True, 0, dict(hinge_weight=10.0)),
]


def loss_and_grads(zs, backend, **kw):
    zs = [z.detach().requires_grad_() for z in zs]
    loss, stats = contrastive_loss(*zs, backend=backend, return_stats=True, **kw)
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)).to("cuda", loss.dtype) + 0.5
    grads = torch.autograd.grad((loss * w).sum(), zs)
    return loss.detach(), stats, grads


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,m2,d,z3,offset,kw", LOSS_CASES)
def test_contrastive_loss_matches_reference(n, m2, d, z3, offset, kw, dtype, backend):
    g = torch.Generator().manual_seed(0)
    zs = [torch.randn(rows, d, generator=g).to("cuda", dtype) for rows in (n, m2, m2)[:3 if z3 else 2]]
    ref = loss_and_grads(zs, "reference", positive_offset=offset, **kw)
    out = loss_and_grads(zs, backend, positive_offset=offset, **kw)
    tol = LOSS_TOL[dtype]
    close("loss", out[0], ref[0], tol)
    for name in ("lse", "pos_sim", "hardest_neg_sim"):
        close(name, getattr(out[1], name), getattr(ref[1], name), tol)
    if dtype == torch.float32:  # in half precision near-ties may legitimately resolve differently
        assert torch.equal(out[1].hardest_neg_index, ref[1].hardest_neg_index)
    for name, a, b, z in zip(("dz1", "dz2", "dz3"), out[2], ref[2], zs):
        assert a.dtype == z.dtype, name
        close(name, a, b, tol)


def test_contrastive_loss_backward_is_deterministic():
    """Both Triton backends: fixed-order reductions (the column splits' merge, the row chunks' accumulation of the
    columns' gradient), no atomics: bitwise the same results twice."""
    g = torch.Generator().manual_seed(0)
    zs = [torch.randn(513, 768, generator=g).cuda() for _ in range(3)]
    for backend in LOSS_BACKENDS:
        a = loss_and_grads(zs, backend, hinge_weight=10.0)
        b = loss_and_grads(zs, backend, hinge_weight=10.0)
        assert torch.equal(a[0], b[0])
        for x, y in zip(a[2], b[2]):
            assert torch.equal(x, y)


# (n, m2, d, k, options): the embedding-training options of tests/ops/test_contrastive_loss_features.py on the GPU
LOSS_OPTION_CASES = [
    (33, 70, 100, 3, dict(positive_offset=20, hardness_mode="all_negatives", hardness_strength=5.0,
                          hard_negative_weight=0.4, hinge_weight=2.0)),
    (65, 65, 96, 1, dict(symmetric=True, partition_mode="joint", hardness_mode="in_batch_negatives",
                         hardness_strength=9.0)),
    (40, 100, 64, 2, dict(symmetric=True, reverse=True, positive_offset=60, ids=True)),
    (50, 50, 128, 2, dict(fn_margin=0.05, fn_margin_strategy="relative", guide=48, hinge_weight=1.0)),
    (70, 70, 768, 1, dict(matryoshka_dims=[768, 64, 256, 128], matryoshka_weights=[1.0, 0.5, 1.0, 2.0],
                          fn_margin=0.1, hardness_mode="hard_negatives", hardness_strength=5.0)),
]


def option_inputs(n, m2, d, k, kw, dtype):
    g = torch.Generator().manual_seed(0)
    kw = dict(kw)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to("cuda", dtype)  # noqa: E731
    zs = [rnd(n, d), rnd(m2, d), rnd(k, m2, d) if k else None, rnd(m2, d) if kw.pop("reverse", False) else None]
    if kw.pop("ids", False):
        kw["column_ids"] = torch.randint(0, m2, (m2 * (1 + k),), generator=g).cuda()
        kw["anchor_ids"] = torch.randint(0, m2 // 2, (m2,), generator=g).cuda()
    dg = kw.pop("guide", None)
    if dg:
        kw["guide"] = (rnd(n, dg), rnd(m2, dg), rnd(k, m2, dg) if k else None)
    return zs, kw


def option_loss_and_grads(zs, backend, **kw):
    leaves = [z.detach().requires_grad_() if z is not None else None for z in zs]
    loss, stats = contrastive_loss(*leaves[:3], reverse_columns=leaves[3], backend=backend, return_stats=True, **kw)
    w = torch.rand(loss.shape, generator=torch.Generator().manual_seed(1)).to("cuda", loss.dtype) + 0.5
    present = [z for z in leaves if z is not None]
    return loss.detach(), stats, torch.autograd.grad((loss * w).sum(), present)


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LOSS_OPTION_CASES, ids=lambda c: "-".join(sorted(c[4])))
def test_contrastive_loss_options_match_reference(case, dtype, backend):
    """Tolerances as above, times the Matryoshka weights' sum (each dimension's loss carries its own error). In
    half precision a guide or model cosine within rounding of a false-negative threshold may fall either side, so
    the margins are wide (0.05-0.1) and only the loss and gradients are compared."""
    zs, kw = option_inputs(*case, dtype)
    ref = option_loss_and_grads(zs, "reference", **kw)
    out = option_loss_and_grads(zs, backend, **kw)
    tol = LOSS_TOL[dtype] * sum(kw.get("matryoshka_weights", [1.0]))
    close("loss", out[0], ref[0], tol)
    if dtype == torch.float32:
        close("lse", out[1].lse, ref[1].lse, tol)
        assert torch.equal(out[1].hardest_neg_index, ref[1].hardest_neg_index)
    for i, (a, b) in enumerate(zip(out[2], ref[2])):
        close(f"grad {i}", a, b, tol)


@pytest.fixture
def tf32():
    """TF32 allowed for CUDA matmuls (the loss's fp32 policy), restored after."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
def test_contrastive_loss_tf32(tf32, backend):
    """fp32 inputs on TF32 tensor cores against the exact reference, at 2u/τ (the module docstring)."""
    zs, kw = option_inputs(*LOSS_OPTION_CASES[0], torch.float32)
    out = option_loss_and_grads(zs, backend, **kw)
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference exact (the fixture restores the setting)
    ref = option_loss_and_grads(zs, "reference", **kw)
    tol = 2 * 2.0 ** -11 / 0.05
    close("loss", out[0], ref[0], tol)
    for i, (a, b) in enumerate(zip(out[2], ref[2])):
        close(f"grad {i}", a, b, tol)


@pytest.mark.parametrize("backend", LOSS_BACKENDS)
def test_contrastive_loss_large_batch_memory(backend):
    """N = 65,536, d = 768, bf16 (issue 42's target): forward + backward within 1.5 GB above the inputs, the loss
    finite. The stripe budget bounds the similarity matrix's share (a row chunk, never N x M)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    zs = [torch.randn(65536, 768, generator=g, device="cuda").to(torch.bfloat16).requires_grad_() for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = contrastive_loss(*zs, backend=backend)
    loss.backward()
    torch.cuda.synchronize()
    peak_gb = (torch.cuda.max_memory_allocated() - base) / 2**30
    assert torch.isfinite(loss) and peak_gb <= 1.5, peak_gb

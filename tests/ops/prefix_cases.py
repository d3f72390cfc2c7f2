"""Inputs of the prefix-attention cases with grouped-query heads, padding on either side, an attention bias and
packed rows: shared by the interpreter tests (test_prefix_attention_triton.py) and the GPU kit's
(test_ops_cuda.py)."""
import torch

from fastprompt.ops.attention_cpu import signed_seed


def op_seed(seed: int) -> torch.Tensor:
    """A dropout seed as the fused op ``fastprompt::prefix_attention_fwd`` takes it: a 0-d int64 tensor."""
    return torch.tensor(signed_seed(seed), dtype=torch.int64)


def make_inputs(B, H, Hkv, S, P, D, T=None, dtype=torch.float32, pad=None, bias=None, bias_dtype=None, seed=0,
                device="cpu"):
    """transformers' layout (``view(B, S, Hkv, D).transpose(1, 2)``); ``pad``: None, "right" or "left" padding with
    example 0 half real and the others of random lengths in [1, S]; ``bias``: the attn_bias shape (requires grad).
    Returns (q, k, v, prefix_k, prefix_v, key_padding_mask, prompt_index, attn_bias)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, S, Hkv, D, generator=g).to(device, dtype).transpose(1, 2).requires_grad_()
            for _ in range(2))
    shape = (Hkv, P, D) if T is None else (T, Hkv, P, D)
    pk, pv = (torch.randn(*shape, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    mask = None
    if pad is not None:
        lengths = torch.randint(1, S + 1, (B,), generator=g)
        lengths[0] = max(1, S // 2)
        pos = torch.arange(S)[None, :]
        mask = (pos < lengths[:, None] if pad == "right" else pos >= S - lengths[:, None]).to(device)
    pidx = None if T is None else (torch.arange(B) % T).to(device)
    attn_bias = None
    if bias is not None:
        attn_bias = torch.randn(*bias, generator=g).to(device, bias_dtype or dtype).requires_grad_()
    return q, k, v, pk, pv, mask, pidx, attn_bias


def pack(x, lengths):
    """(B, heads, L, D) right-padded rows -> (1, heads, N, D) packed rows."""
    return torch.cat([x[b, :, :n] for b, n in enumerate(lengths)], 1).unsqueeze(0)


def cu_seqlens(lengths, dtype=torch.int32, device="cpu"):
    """(B + 1,) offsets of sequences of the given lengths packed back to back."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=dtype, device=device)


def packed_inputs(lengths, H, Hkv, P, D, T=None, dtype=torch.float32, bias=None, L=None, seed=0, device="cpu"):
    """A packed batch of the given lengths, padded to L (default: the longest), and its padded twin (same values,
    zeros after each sequence). Returns (packed inputs, cu_seqlens, L, padded inputs), inputs as make_inputs'."""
    L = L or max(lengths)
    B = len(lengths)
    q, k, v, pk, pv, _, pidx, attn_bias = make_inputs(B, H, Hkv, L, P, D, T, dtype, bias=bias, seed=seed,
                                                      device=device)
    mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).to(device)
    with torch.no_grad():  # zeros after each sequence in the padded twin
        for x in (q, k, v):
            x.masked_fill_(~mask[:, None, :, None], 0.0)
    packed = [pack(x.detach(), lengths).requires_grad_() for x in (q, k, v)]
    return ((*packed, pk, pv, None, pidx, attn_bias), cu_seqlens(lengths, device=device), L,
            (q, k, v, pk, pv, mask, pidx, attn_bias))



"""The prefix-attention reference itself, against independent constructions: PyTorch's SDPA (its own causal,
grouped-query and additive-mask handling) over an explicit concatenation, and padded against packed rows."""
import pytest
import torch
import torch.nn.functional as F

from fastprompt.ops.reference import prefix_attention_reference


def _sdpa_concat(q, k, v, pk, pv, allowed_tokens, bias=None):
    """SDPA over [prefix ; tokens] with a boolean (S, S) token-visibility matrix: float64, no shared code."""
    B, H, S, D = q.shape
    Hkv, P = k.shape[1], pk.shape[-2]
    keys = torch.cat([pk.expand(B, -1, -1, -1), k], 2)
    values = torch.cat([pv.expand(B, -1, -1, -1), v], 2)
    mask = torch.zeros(B, H, S, P + S, dtype=q.dtype)
    mask[..., P:] = torch.where(allowed_tokens, 0.0, float("-inf"))
    if bias is not None:
        mask[..., P:] += bias
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=Hkv != H)


@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (2, 0)),
                                           (False, (1, 2))])
def test_masks_and_gqa_match_sdpa(H, Hkv, causal, window):
    g = torch.Generator().manual_seed(0)
    B, S, D, P = 2, 7, 8, 3
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    pk, pv = (torch.randn(Hkv, P, D, generator=g, dtype=torch.float64) for _ in range(2))
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = torch.ones(S, S, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if window[0] >= 0:
        allowed &= j >= i - window[0]
    if window[1] >= 0:
        allowed &= j <= i + window[1]
    bias = torch.randn(1, H, S, S, generator=g, dtype=torch.float64)
    got = prefix_attention_reference(q, k, v, pk, pv, causal=causal, window=window, attn_bias=bias)
    torch.testing.assert_close(got, _sdpa_concat(q, k, v, pk, pv, allowed, bias), rtol=1e-12, atol=1e-12)


def test_packed_equals_padded():
    g = torch.Generator().manual_seed(1)
    lengths, H, Hkv, D, P = [1, 5, 3], 4, 2, 8, 2
    L = max(lengths)
    B = len(lengths)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    pk, pv = (torch.randn(2, Hkv, P, D, generator=g, dtype=torch.float64) for _ in range(2))
    index = torch.tensor([1, 0, 1])
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    bias = torch.randn(1, H, L, L, generator=g, dtype=torch.float64)
    kw = dict(prompt_index=index, causal=True, attn_bias=bias, return_lse=True)
    padded, lse = prefix_attention_reference(q, k, v, pk, pv, mask, **kw)

    def pack(x):
        return torch.cat([x[b, :, :n] for b, n in enumerate(lengths)], 1).unsqueeze(0)

    cu = torch.tensor([0, 1, 6, 9])
    packed, plse = prefix_attention_reference(pack(q), pack(k), pack(v), pk, pv, cu_seqlens=cu, **kw)
    torch.testing.assert_close(packed, pack(padded), rtol=0, atol=0)
    torch.testing.assert_close(plse, torch.cat([lse[b, :, :n] for b, n in enumerate(lengths)], 1)[None])

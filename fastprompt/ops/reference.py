"""Plain-PyTorch ground truth for every fused op in ``fastprompt.ops``.

These functions are deliberately simple (they materialise everything) and are used by the tests
and as the last-resort fallback backend. Autograd differentiates them.
"""
import torch  # noqa: F401

from fastprompt.constants import COSINE_EPS

# --- contrastive loss ----------------------------------------------------------------------------


def contrastive_loss_reference(
    z1,
    z2,
    z3=None,
    *,
    temperature=0.05,
    hard_negative_weight=0.0,
    hinge_margin=0.2,
    hinge_weight=0.0,
    symmetric=False,
    reduction="mean",
    return_stats=False,
    positive_offset=0,
):
    """In-batch cosine InfoNCE + PromCSE energy-based hinge, materialising the N x M similarity matrix.

    Columns are ``cat(z2, z3)``; the positive of anchor ``i`` is column ``positive_offset + i``.
    Per row: ``ce_i = logsumexp_j(l_ij) - l_i,pos`` with ``l_ij = cos_ij / temperature`` plus
    ``hard_negative_weight`` on column ``m2 + positive_offset + i`` (the anchor's own hard negative
    ``z3[positive_offset + i]``; the other z3 rows are plain negatives, as in SimCSE); with ``symmetric``
    the row loss is ``(ce_i + ce_sym_i) / 2`` where ``ce_sym_i`` is the cross-entropy of positive ``z2[pos_i]``
    against the columns ``z1``. ``hinge_i = relu(hinge_margin + cos(z1_i, h_i) - cos(z1_i, z2[pos_i]))`` with
    ``h_i`` the column of largest cosine other than the positive (on cosines, without the hard-negative bias, as in
    PromCSE). Row loss = ce + hinge_weight * hinge. Computation is in float32 (float64 stays float64).
    """
    import torch.nn.functional as F

    cdt = torch.promote_types(z1.dtype, torch.float32)
    n, m2 = z1.shape[0], z2.shape[0]
    a = F.normalize(z1.to(cdt), dim=-1, eps=COSINE_EPS)
    cols = z2 if z3 is None else torch.cat([z2, z3], 0)
    b = F.normalize(cols.to(cdt), dim=-1, eps=COSINE_EPS)
    sim = a @ b.T  # (N, M) cosines
    logits = sim / temperature
    rows = torch.arange(n, device=z1.device)
    pos = rows + positive_offset
    if z3 is not None and hard_negative_weight != 0.0:  # only each anchor's own hard negative, as SimCSE
        bias = torch.zeros_like(logits)
        bias[rows, m2 + pos] = hard_negative_weight
        logits = logits + bias
    lse = torch.logsumexp(logits, dim=1)
    loss = lse - logits[rows, pos]
    lse_sym = None
    if symmetric:
        sym_logits = sim[:, positive_offset:positive_offset + n].T / temperature  # rows: positives, cols: z1
        lse_sym = torch.logsumexp(sym_logits, dim=1)
        loss = 0.5 * (loss + lse_sym - sym_logits.diagonal())
    pos_sim = sim[rows, pos]
    hard_sim = hard_idx = None
    if hinge_weight != 0.0 or return_stats:  # the hardest negative costs another N x M pass
        is_pos = torch.zeros_like(sim, dtype=torch.bool)
        is_pos[rows, pos] = True
        hard_sim, hard_idx = sim.masked_fill(is_pos, float("-inf")).max(dim=1)
    if hinge_weight != 0.0:
        loss = loss + hinge_weight * torch.relu(hinge_margin + hard_sim - pos_sim)
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    elif reduction != "none":
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not return_stats:
        return loss
    from fastprompt.ops.contrastive import ContrastiveStats

    stats = ContrastiveStats(
        lse=lse.detach(),
        pos_sim=pos_sim.detach(),
        hardest_neg_sim=hard_sim.detach(),
        hardest_neg_index=hard_idx,
        lse_sym=None if lse_sym is None else lse_sym.detach(),
    )
    return loss, stats


# --- prefix attention ----------------------------------------------------------------------------


def prefix_attention_dropout_mask(seed, shape, dropout_p, device):
    """Keep-mask (True = kept) of the reference and CPU paths: a pure function of (seed, shape, p)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(1.0 - dropout_p, generator=gen)


def prefix_attention_reference(
    q,
    k,
    v,
    prefix_k,
    prefix_v,
    key_padding_mask=None,
    *,
    scale=None,
    dropout_p=0.0,
    seed=None,
    prompt_index=None,
    return_lse=False,
    dropout_mask=None,
    causal=False,
    window=(-1, -1),
    attn_bias=None,
    cu_seqlens=None,
    max_seqlen=None,
):
    """Attention of ``q`` over the explicit concatenation ``[prefix ; tokens]``, computed in float32.

    Padded layout: q (B, H, S, D); k, v (B, Hkv, S, D) with ``H % Hkv == 0`` (grouped-query / multi-query
    attention: query head h reads key/value head ``h // (H // Hkv)``, transformers' ``repeat_kv`` order);
    prefix_k/prefix_v (Hkv, P, D) shared, or (T, Hkv, P, D) picked per example by ``prompt_index`` (B,).
    ``key_padding_mask`` (B, S) bool, True = real token.

    The prefix columns are visible to every query row, always: the mask rules below apply to the token block
    only (P-tuning v2 / PEFT semantics: the prefix is a set of extra keys/values every token sees, also under
    a causal mask or a sliding window). Token j is visible to query i when it is a real token and
      - ``causal``: ``j <= i`` (row indices; with left padding the pads sit before every real token);
      - ``window=(left, right)``: ``i - left <= j <= i + right``, ``-1`` = unbounded on that side
        (FlashAttention's ``window_size``; a causal sliding window of W tokens is ``(W - 1, 0)``).
    ``attn_bias``: an additive float bias on the token block's scores (after scaling), broadcastable as
    (1 or B, 1 or H, S, S) (MPNet's relative position bias); the prefix columns get none.

    Packed (variable-length) layout: with ``cu_seqlens`` (B + 1,) int offsets, q is (1, H, N, D) and k, v
    (1, Hkv, N, D) holding the N = cu_seqlens[-1] real tokens of B sequences back to back; sequence b is rows
    ``cu_seqlens[b]:cu_seqlens[b + 1]`` and attends to its own tokens (row indices counted from its start)
    and its prefix. ``key_padding_mask`` must be None; ``attn_bias`` is (1 or B, 1 or H, L, L) indexed by
    in-sequence positions, L = ``max_seqlen`` (default: the longest sequence). The result equals the padded
    computation of the same sequences right-padded to L, repacked: that is how it is computed here.

    A row with no visible key (P = 0 and nothing visible in the token block) outputs zeros, log-sum-exp -inf.
    Dropout (on the probabilities) uses :func:`prefix_attention_dropout_mask` with ``seed`` (0 if None), or
    the given boolean ``dropout_mask`` of the padded layout (B, H, S, P + S) (packed: (B, H, L, P + L)).
    Returns ``out`` in q's layout and dtype, plus the natural-log log-sum-exp (B, H, S) (packed: (1, H, N))
    with ``return_lse``.
    """
    if cu_seqlens is not None:
        return _packed_reference(q, k, v, prefix_k, prefix_v, key_padding_mask, cu_seqlens, max_seqlen,
                                 scale=scale, dropout_p=dropout_p, seed=seed, prompt_index=prompt_index,
                                 return_lse=return_lse, dropout_mask=dropout_mask, causal=causal, window=window,
                                 attn_bias=attn_bias)
    B, H, S, D = q.shape
    group = H // k.shape[1]
    cd = torch.promote_types(q.dtype, torch.float32)
    scale = D ** -0.5 if scale is None else scale
    if prefix_k.dim() == 3:
        pk, pv = (p.unsqueeze(0).expand(B, -1, -1, -1) for p in (prefix_k, prefix_v))
    else:
        pk, pv = prefix_k[prompt_index], prefix_v[prompt_index]
    P = pk.shape[2]
    keys = torch.cat([pk, k], 2).to(cd).repeat_interleave(group, dim=1)
    values = torch.cat([pv, v], 2).to(cd).repeat_interleave(group, dim=1)
    visible = torch.ones(B, 1, S, P + S, dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        visible[..., P:] &= key_padding_mask.to(torch.bool)[:, None, None, :]
    i = torch.arange(S, device=q.device)[:, None]
    j = torch.arange(S, device=q.device)[None, :]
    left, right = window
    if causal:
        visible[..., P:] &= j <= i
    if left >= 0:
        visible[..., P:] &= j >= i - left
    if right >= 0:
        visible[..., P:] &= j <= i + right
    scores = (q.to(cd) @ keys.transpose(-1, -2)) * scale
    if attn_bias is not None:
        scores = torch.cat([scores[..., :P], scores[..., P:] + attn_bias.to(cd)], -1)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    if dropout_p > 0:
        keep = dropout_mask
        if keep is None:
            keep = prefix_attention_dropout_mask(0 if seed is None else seed, probs.shape, dropout_p, q.device)
        probs = probs * keep / (1.0 - dropout_p)
    out = (probs @ values).to(q.dtype)
    return (out, lse) if return_lse else out


def _packed_reference(q, k, v, prefix_k, prefix_v, key_padding_mask, cu_seqlens, max_seqlen, *, return_lse,
                      **kwargs):
    """The packed layout of :func:`prefix_attention_reference`: unpack to right-padded rows, attend, repack."""
    if key_padding_mask is not None:
        raise ValueError("a packed batch (cu_seqlens) has no padding: key_padding_mask must be None")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    B, L = len(lengths), max(lengths) if max_seqlen is None else int(max_seqlen)

    def unpack(x):  # (1, heads, N, D) -> (B, heads, L, D), zeros after each sequence
        out = x.new_zeros(B, x.shape[1], L, x.shape[-1])
        for b, (s, n) in enumerate(zip(bounds, lengths)):
            out[b, :, :n] = x[0, :, s:s + n]
        return out

    mask = torch.zeros(B, L, dtype=torch.bool, device=q.device)
    for b, n in enumerate(lengths):
        mask[b, :n] = True
    out, lse = prefix_attention_reference(unpack(q), unpack(k), unpack(v), prefix_k, prefix_v, mask,
                                          return_lse=True, **kwargs)
    out = torch.cat([out[b, :, :n] for b, n in enumerate(lengths)], 1).unsqueeze(0)
    lse = torch.cat([lse[b, :, :n] for b, n in enumerate(lengths)], 1).unsqueeze(0)
    return (out, lse) if return_lse else out

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
):
    """Attention of ``q`` over the explicit concatenation ``[prefix ; tokens]``, computed in float32.

    q, k, v: (B, H, S, D); prefix_k/prefix_v: (H, P, D) shared, or (T, H, P, D) picked per example by
    ``prompt_index`` (B,). ``key_padding_mask`` (B, S) bool, True = real token; prefix keys are always
    visible. A row with no visible key (P = 0 and an all-padding example) outputs zeros, log-sum-exp -inf.
    Dropout (on the probabilities) uses :func:`prefix_attention_dropout_mask` with ``seed`` (0 if None), or
    the given boolean ``dropout_mask`` (B, H, S, P + S) (tests use it to replay the Triton kernel's mask).
    Returns ``out`` (B, H, S, D) in q's dtype, plus the natural-log log-sum-exp (B, H, S) with ``return_lse``.
    """
    B, H, S, D = q.shape
    cd = torch.promote_types(q.dtype, torch.float32)
    scale = D ** -0.5 if scale is None else scale
    if prefix_k.dim() == 3:
        pk, pv = (p.unsqueeze(0).expand(B, -1, -1, -1) for p in (prefix_k, prefix_v))
    else:
        pk, pv = prefix_k[prompt_index], prefix_v[prompt_index]
    P = pk.shape[2]
    keys = torch.cat([pk, k], 2).to(cd)
    values = torch.cat([pv, v], 2).to(cd)
    visible = torch.ones(B, P + S, dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        visible[:, P:] = key_padding_mask.to(torch.bool)
    scores = (q.to(cd) @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    if dropout_p > 0:
        keep = dropout_mask
        if keep is None:
            keep = prefix_attention_dropout_mask(0 if seed is None else seed, probs.shape, dropout_p, q.device)
        probs = probs * keep / (1.0 - dropout_p)
    out = (probs @ values).to(q.dtype)
    return (out, lse) if return_lse else out

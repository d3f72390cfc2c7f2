"""Plain-PyTorch ground truth for every fused op in ``fastprompt.ops``.

These functions are deliberately simple (they materialise everything) and are used by the tests
and as the last-resort fallback backend. Autograd differentiates them.
"""
import torch

from fastprompt.constants import COSINE_EPS
from fastprompt.ops.types import ContrastiveStats

# --- contrastive loss ----------------------------------------------------------------------------


def hardness_coefficients(hardness_mode, hardness_strength):
    """``(alpha_in_batch, alpha_own)``: the hardness penalty ``alpha * stop_grad(cos)`` on the in-batch negatives
    (every column that is not the anchor's own positive or own negative) and on the anchor's own negatives, for
    sentence-transformers' ``hardness_mode`` (``MultipleNegativesRankingLoss``, Lan et al. 2025 Eq. 5)."""
    if hardness_mode is None or hardness_strength == 0.0:
        return 0.0, 0.0
    a = float(hardness_strength)
    return {"in_batch_negatives": (a, 0.0), "hard_negatives": (0.0, a), "all_negatives": (a, a)}[hardness_mode]


def fn_threshold(pos_score, fn_margin, fn_margin_strategy):
    """GISTEmbed's false-negative threshold per anchor: a column scoring above it is not a negative."""
    if fn_margin_strategy == "relative":
        return pos_score - pos_score.abs() * fn_margin
    return pos_score - fn_margin


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
    partition_mode="per_direction",
    reverse_columns=None,
    hardness_mode=None,
    hardness_strength=0.0,
    column_ids=None,
    anchor_ids=None,
    fn_margin=None,
    fn_margin_strategy="absolute",
    guide=None,
    matryoshka_dims=None,
    matryoshka_weights=None,
    reduction="mean",
    return_stats=False,
    positive_offset=0,
):
    """In-batch cosine InfoNCE with every option of :func:`fastprompt.ops.contrastive_loss`, materialising the
    N x M similarity matrix (and one per Matryoshka dimension). Computed in float32 (float64 stays float64).

    Columns are ``cat(z2, z3[0], ..., z3[k-1])`` (z3 is (M2, d), k = 1, or (k, M2, d)); anchor ``i``'s positive
    is column ``p(i) = positive_offset + i``, its own negatives are the columns ``M2 * (1 + j) + p(i)``. Per
    Matryoshka dimension ``d_t`` (all of d without ``matryoshka_dims``) on the re-normalised prefixes:

    - logits ``l_ij = cos_ij / temperature`` plus ``hard_negative_weight`` on the own negatives, plus the hardness
      penalty ``alpha * cos_ij`` taken as a constant (no gradient) on the negatives ``hardness_mode`` selects;
    - false negatives are left out of the softmax (logit -inf): a column whose ``column_ids`` entry equals the
      positive's (the same text), a column with a negative id (no text: padding), and with ``fn_margin`` a column
      whose score exceeds the positive's score minus the margin (GISTEmbed: scored by ``guide``'s cosines if
      given, else by the model's own); the positive itself never is;
    - ``ce_i = logsumexp_j l_ij - l_i,p(i)``; with ``symmetric`` the reverse term scores the positive ``z2[p(i)]``
      against the columns ``reverse_columns`` (default z1; its target is row ``p(i)`` of reverse_columns, or
      ``i`` of z1), masked alike with ``anchor_ids``: ``per_direction`` averages the two cross-entropies,
      ``joint`` takes one softmax over both blocks (sentence-transformers' ``partition_mode``);
    - PromCSE's hinge ``relu(hinge_margin + cos(h) - cos(p))`` on the hardest negative: the largest cosine over
      the columns left in the softmax other than the positive (index -1 and no hinge when none is left).

    The row loss is ``sum_t w_t (ce_t + hinge_weight * hinge_t)``. Autograd differentiates it.
    """
    import torch.nn.functional as F

    cdt = torch.promote_types(z1.dtype, torch.float32)
    n, d = z1.shape
    m2 = z2.shape[0]
    dev = z1.device
    negatives = None if z3 is None else (z3 if z3.dim() == 3 else z3.unsqueeze(0))
    k = 0 if negatives is None else negatives.shape[0]
    cols = z2 if k == 0 else torch.cat([z2, negatives.reshape(k * m2, -1)], 0)
    m = cols.shape[0]
    rows = torch.arange(n, device=dev)
    pos = rows + positive_offset
    col = torch.arange(m, device=dev)[None, :]
    is_pos = col == pos[:, None]
    own = (col >= m2) & ((col - m2) % m2 == pos[:, None])
    a_in, a_own = hardness_coefficients(hardness_mode, hardness_strength)
    own_f, in_batch_f = own.to(cdt), (~own & ~is_pos).to(cdt)
    penalty = a_own * own_f + a_in * in_batch_f  # (computed in cdt: a float32 constant would round the weights)
    bias = float(hard_negative_weight) * own_f

    rev = z1 if reverse_columns is None else reverse_columns
    rlabel = rows if reverse_columns is None else pos
    rcol = torch.arange(rev.shape[0], device=dev)[None, :]
    r_is_target = rcol == rlabel[:, None]

    id_mask = torch.zeros(n, m, dtype=torch.bool, device=dev)
    r_id_mask = torch.zeros(n, rev.shape[0], dtype=torch.bool, device=dev)
    if column_ids is not None:
        id_mask = (column_ids[None, :] == column_ids[pos][:, None]) | (column_ids[None, :] < 0)
    if anchor_ids is not None:
        r_id_mask = (anchor_ids[None, :] == anchor_ids[rlabel][:, None]) | (anchor_ids[None, :] < 0)

    def cosines(x, y, dim=None):
        x, y = (x if dim is None else x[:, :dim]), (y if dim is None else y[:, :dim])
        return F.normalize(x.to(cdt), dim=-1, eps=COSINE_EPS) @ F.normalize(y.to(cdt), dim=-1, eps=COSINE_EPS).T

    guide_sim = guide_rsim = None
    if fn_margin is not None and guide is not None:
        g1, g2, g3, grev = (tuple(guide) + (None, None))[:4]
        gneg = None if g3 is None else (g3 if g3.dim() == 3 else g3.unsqueeze(0))
        gcols = g2 if gneg is None else torch.cat([g2, gneg.reshape(-1, g2.shape[1])], 0)
        guide_sim = cosines(g1, gcols)
        if symmetric:
            guide_rsim = cosines(g2[pos], g1 if grev is None else grev)

    dims = list(matryoshka_dims) if matryoshka_dims is not None else [d]
    weights = list(matryoshka_weights) if matryoshka_weights is not None else [1.0] * len(dims)
    total = 0.0
    per_dim = {key: [] for key in ("lse", "pos_sim", "hardest_neg_sim", "hardest_neg_index", "lse_sym")}
    for dim, weight in zip(dims, weights):
        sim = cosines(z1, cols, dim)  # (N, M) cosines of the prefixes
        mask = id_mask
        thr = None
        if fn_margin is not None:
            score = guide_sim if guide_sim is not None else sim.detach()
            thr = fn_threshold(score[rows, pos], fn_margin, fn_margin_strategy)
            mask = mask | (score > thr[:, None])
        mask = mask & ~is_pos
        logits = sim / temperature + bias + penalty * sim.detach()
        logits = logits.masked_fill(mask, float("-inf"))
        lse = torch.logsumexp(logits, dim=1)
        pos_logit = sim[rows, pos] / temperature
        loss = lse - pos_logit
        lse_sym = None
        if symmetric:
            rsim = cosines(z2[pos], rev, dim)  # rows: the positives, columns: the anchors
            rmask = r_id_mask
            if fn_margin is not None:
                rscore = guide_rsim if guide_rsim is not None else rsim.detach()
                rmask = rmask | (rscore > thr[:, None])
            rlogits = (rsim / temperature).masked_fill(rmask & ~r_is_target, float("-inf"))
            lse_sym = torch.logsumexp(rlogits, dim=1)
            if partition_mode == "joint":
                loss = torch.logaddexp(lse, lse_sym) - pos_logit
            else:
                loss = 0.5 * (loss + lse_sym - rlogits[rows, rlabel])
        pos_sim = sim[rows, pos]
        hard_sim = hard_idx = None
        if hinge_weight != 0.0 or return_stats:  # the hardest negative costs another N x M pass
            hard_sim, hard_idx = sim.masked_fill(mask | is_pos, float("-inf")).max(dim=1)
            hard_idx = torch.where(torch.isinf(hard_sim), -1, hard_idx)
        if hinge_weight != 0.0:
            loss = loss + hinge_weight * torch.relu(hinge_margin + hard_sim - pos_sim)
        total = total + weight * loss
        for key, value in (("lse", lse), ("pos_sim", pos_sim), ("hardest_neg_sim", hard_sim),
                           ("hardest_neg_index", hard_idx), ("lse_sym", lse_sym)):
            per_dim[key].append(value)
    loss = total
    if reduction == "mean":
        loss = loss.mean()
    elif reduction == "sum":
        loss = loss.sum()
    elif reduction != "none":
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not return_stats:
        return loss
    def stat(key):  # (N,) without matryoshka_dims, else (N, D), column t for matryoshka_dims[t]
        values = per_dim[key]
        if values[0] is None:
            return None
        values = [v.detach() for v in values]
        return values[0] if matryoshka_dims is None else torch.stack(values, 1)

    return loss, ContrastiveStats(stat("lse"), stat("pos_sim"), stat("hardest_neg_sim"), stat("hardest_neg_index"),
                                  stat("lse_sym"))


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


def dropout_add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p, keep=None):
    """``layer_norm(x * keep / (1 - p) + residual)`` over the last dimension, in plain PyTorch: the ground truth of
    :func:`fastprompt.ops.add_norm.dropout_add_layer_norm` given its keep decisions ``keep`` (bool, x's shape,
    True = kept; :func:`fastprompt.ops.add_norm.keep_mask` of the flattened rows), None for no dropout."""
    dropped = x if keep is None else x * keep.to(x.dtype) * (1.0 / (1.0 - dropout_p))
    return torch.nn.functional.layer_norm(dropped + residual, (x.shape[-1],), weight, bias, eps)

"""The last layer for the rows the pooler reads only (a packed batch with ``cls``, ``mask`` or ``last`` pooling).

Only one token per sequence leaves the backbone into a sentence vector, so the last layer's queries, attention
output, output projection and feed-forward run for those rows only; its keys and values still come from every
token (the pooled row attends to its whole sequence and the prefix). For a 6-layer MiniLM that is about a sixth of
the step's matrix work.

It is installed on BERT-style last layers (BERT, RoBERTa, XLM-RoBERTa, ELECTRA: a self-attention with
``query``/``key``/``value``, then ``attention.output`` and ``feed_forward_chunk``, all row-wise but the attention),
by replacing that one module instance's ``forward`` with :func:`_rows_forward`, which runs the original forward
unless the :class:`~fastprompt.model.attention.PrefixState` of the call names pooled rows. The layer's own output
and feed-forward modules compute the rows, so their maths (dropout, LayerNorm, activation) is the model's; the
attention of the R pooled queries is computed here (R x (P + S) scores, negligible next to the projections).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: the last-layer classes :func:`install` accepts (the BERT layout; tests/model/test_packed.py checks each)
ROW_LAYERS = ("BertLayer", "RobertaLayer", "XLMRobertaLayer", "ElectraLayer")


def install(layers) -> bool:
    """Let the last of ``layers`` (the backbone's layer list) compute pooled rows only; False when it is not of a
    supported kind (it then always runs whole)."""
    if not layers:
        return False
    last = layers[-1]
    if type(last).__name__ not in ROW_LAYERS or getattr(last, "is_decoder", False) or \
            hasattr(last, "crossattention") or getattr(last, "chunk_size_feed_forward", 0):
        return False
    last.forward = functools.partial(_rows_forward, last, last.forward)
    return True


def _rows_forward(layer, whole, hidden_states, *args, fastprompt_state=None, **kwargs):
    state = fastprompt_state
    if state is None or state.pooled_rows is None:
        return whole(hidden_states, *args, fastprompt_state=state, **kwargs)
    return layer_rows(layer, hidden_states, state)


def layer_rows(layer, hidden: torch.Tensor, state) -> torch.Tensor:
    """The last layer's output (1, R, hidden) at the packed rows ``state.pooled_rows`` (R,), one per sequence, of
    the packed ``hidden`` (1, N, hidden)."""
    from .attention import layer_index, prefix_entry

    sa = layer.attention.self
    rows = state.pooled_rows
    x = hidden[:, rows]  # (1, R, hidden)
    B, S = state.padded_index.shape
    nh, d = sa.num_attention_heads, sa.attention_head_size
    q = sa.query(x[0]).view(B, 1, nh, d).transpose(1, 2)  # (B, nh, 1, d): one query per sequence
    # keys/values of every token, laid out per sequence (B, nh, S, d); padding columns are masked below
    k, v = (lin(hidden[0])[state.padded_index.clamp_min(0)].view(B, S, nh, d).transpose(1, 2)
            for lin in (sa.key, sa.value))
    layer_id = layer_index(sa, state)
    state.served.add(layer_id)
    pk, pv = prefix_entry(state, layer_id, k)
    if pk.dim() == 3:
        pk, pv = pk.expand(B, -1, -1, -1), pv.expand(B, -1, -1, -1)
    keys, values = torch.cat([pk.to(q.dtype), k], 2), torch.cat([pv.to(q.dtype), v], 2)
    scores = (q @ keys.transpose(-1, -2)) * sa.scaling  # (B, nh, 1, P + S)
    visible = torch.cat([state.padded_index.new_ones(B, pk.shape[2], dtype=torch.bool), state.padded_index >= 0], 1)
    scores = scores.masked_fill(~visible[:, None, None, :], torch.finfo(scores.dtype).min)
    probs = F.dropout(scores.softmax(-1), sa.dropout.p, sa.training)
    context = (probs @ values).transpose(1, 2).reshape(1, B, nh * d)
    return layer.feed_forward_chunk(layer.attention.output(context, x))

"""MPNet (all-mpnet-base-v2 and other sentence-transformers models): its attention modules compute attention
themselves and its forward passes no keywords down, so the prefix enters through adapters of each
``MPNetSelfAttention`` instance's ``forward`` (the same projections through ``prefix_attention``, MPNet's relative
position bias as the op's additive bias of the token block; the prefix columns get none: a prefix key has no
position) and, for packed batches, of ``MPNetEncoder.compute_position_bias``. Its feed-forward output
(``MPNetOutput``) gets the fused dropout + add + LayerNorm; its attention adds and normalises inside its own forward.
"""
from __future__ import annotations

from ..attention import OwnAttention, layer_index, prefix_entry, run_prefix_attention
from .family import Adapter, Family, Upstream, register_family

MODULE = "transformers.models.mpnet.modeling_mpnet"
SELF_ATTENTION = Upstream(MODULE, "MPNetSelfAttention", "(self, hidden_states, attention_mask=None, "
                          "position_bias=None, output_attentions=False, **kwargs)", "8e2c44e25640b3ea")
POSITION_BIAS = Upstream(MODULE, "MPNetEncoder", "(self, x, position_ids=None, num_buckets=32)", "9e5e63d42c67b2cc",
                         method="compute_position_bias")
OUTPUT = Upstream(MODULE, "MPNetOutput", "(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> "
                  "torch.Tensor", "0650f56bc438ef17")


def self_attention(module, slot: OwnAttention, hidden_states, attention_mask=None, position_bias=None,
                          output_attentions=False, **kwargs):
    """MPNetSelfAttention.forward with the prefix: MPNet's relative position bias is the additive ``attn_bias`` of
    the token block; the prefix columns get none (the prefix has no position, so no relative distance to bucket,
    as in P-tuning v2 where the prefix only enters attention). ``attention_mask`` (eager's additive mask) is
    replaced by the state's (B, S) padding mask. In a packed batch every layer runs the variable-length op (an
    empty prefix where it has none), with the (1, H, L, L) bias of :func:`position_bias`, which the op
    indexes by each sequence's own positions."""
    state = slot.state
    layer = layer_index(module, state)
    entry = None
    if state is not None and layer is not None:
        state.served.add(layer)
        if state.capture is not None:
            shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
            k, v = (lin(hidden_states[:1]).view(1, *shape[1:]).transpose(1, 2)[0] for lin in (module.k, module.v))
            state.capture[layer] = (k.detach(), v.detach())
        # the (H, 0, D) shape prefix_entry reads from the keys: MPNet has as many key heads as query heads
        entry = prefix_entry(state, layer, hidden_states.new_empty(1, module.num_attention_heads, 0,
                                                                    module.attention_head_size))
    if entry is None or output_attentions:
        if entry is not None:
            raise ValueError("output_attentions is not available with a prefix (the fused op keeps no probabilities)")
        return type(module).forward(module, hidden_states, attention_mask, position_bias, output_attentions, **kwargs)
    B, S = hidden_states.shape[:2]
    q, k, v = (lin(hidden_states).view(B, S, -1, module.attention_head_size).transpose(1, 2)
               for lin in (module.q, module.k, module.v))
    pk, pv = (t.to(q.dtype) for t in entry)
    out = run_prefix_attention(state, q, k, v, pk, pv, scale=module.attention_head_size ** -0.5,
                               dropout_p=module.dropout.p if module.training else 0.0,
                               prompt_index=state.prompt_index, attn_bias=position_bias)
    return (module.o(out.transpose(1, 2).reshape(B, S, -1)),)


def position_bias(module, slot: OwnAttention, x, position_ids=None, num_buckets=32):
    """MPNetEncoder.compute_position_bias; in a packed batch ((1, N) activations) the bias of one padded row of
    ``max_seqlen`` tokens, (1, H, L, L), instead of an (N, N) matrix over the packed row. The bias depends on the
    distance between two tokens only, so the op's indexing by each sequence's own positions gives every sequence
    the bias it has in the padded batch (left or right padded alike)."""
    state = slot.state
    if state is not None and state.cu_seqlens is not None and position_ids is None:
        x = x.new_empty(1, state.max_seqlen, 0)
    return type(module).compute_position_bias(module, x, position_ids, num_buckets)


register_family(Family(
    "mpnet", "MPNet", attention="adapters", adapters=(Adapter(SELF_ATTENTION, self_attention),
                                                       Adapter(POSITION_BIAS, position_bias)),
    add_norm=(OUTPUT,), packs=True, onnx=True, lora_targets=("q", "k", "v", "o"),
    peft="MPNet computes attention in its own modules and its position bias does not cover PEFT's cache (a size "
         "mismatch at the first forward)",
    compared=("explicit concatenation", "AutoModel", "sentence-transformers (real weights)")))

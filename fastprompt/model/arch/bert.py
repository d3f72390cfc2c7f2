"""BERT-like encoders: BERT, RoBERTa, XLM-RoBERTa, ELECTRA (one layout: a self-attention with ``query``/``key``/
``value``, then ``attention.output`` and ``feed_forward_chunk``).

Their attention goes through transformers' attention functions, so the prefix enters through the registered one.
RoBERTa and XLM-RoBERTa number positions from the padding index + 1 (:mod:`fastprompt.model.arch.positions` reads
that from the embeddings). Their ``SelfOutput``/``Output`` modules close each attention and feed-forward block
with dense -> dropout -> LayerNorm(h + input), which the fused op computes in training; in a packed batch the last
layer computes the pooled rows only (:func:`layer_rows`). PEFT's prefix tuning runs on all four
(tests/integrations/test_peft_attention.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import layer_index, prefix_entry
from .family import Adapter, Family, Upstream, register_family

#: the signatures (transformers 5.24) of the methods the family's replacements were written against
OUTPUT_SIGNATURE = "(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor"
LAYER_SIGNATURE = ("(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, "
                   "encoder_hidden_states: torch.Tensor | None = None, encoder_attention_mask: torch.Tensor | None = "
                   "None, cache: transformers.cache_utils.Cache | None = None, **kwargs: *<class "
                   "'transformers.utils.generic.TransformersKwargs'>) -> torch.Tensor")
SELF_ATTENTION_SIGNATURE = ("(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: "
                            "transformers.cache_utils.Cache | None = None, **kwargs: *<class "
                            "'transformers.utils.generic.TransformersKwargs'>) -> tuple[torch.Tensor]")
OUTPUT_SHA, LAYER_SHA = "0650f56bc438ef17", "3e5a9ede068d4d43"


def layer_rows(layer, hidden: torch.Tensor, state) -> torch.Tensor:
    """The last layer's output (1, R, hidden) at the packed rows ``state.pooled_rows`` (R,), one per sequence, of
    the packed ``hidden`` (1, N, hidden): the layer's own query projection, output and feed-forward modules for
    those rows only; the keys and values of every token (the pooled row attends to its whole sequence and the
    prefix); the attention of the R pooled queries computed here (R x (P + S) scores)."""
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


def bert_like(model_type: str, package: str, prefix: str, self_attention_sha: str) -> Family:
    """The spec of one BERT-like ``model_type`` whose classes are ``transformers.models.<package>``'s
    ``<prefix>Layer``, ``<prefix>SelfOutput``, ... (``self_attention_sha``: the pin of its ``SelfAttention.forward``,
    which :func:`layer_rows` reproduces for the pooled rows)."""
    module = f"transformers.models.{package}.modeling_{package}"
    rows = Adapter(Upstream(module, f"{prefix}Layer", LAYER_SIGNATURE, LAYER_SHA), layer_rows,
                   reproduces=(Upstream(module, f"{prefix}SelfAttention", SELF_ATTENTION_SIGNATURE,
                                        self_attention_sha),))
    return Family(model_type, "BERT-like encoders", pooled_rows=rows, packs=True, onnx=True,
                  lora_targets=("query", "key", "value", "dense"),  # dense: attention output, intermediate, output
                  add_norm=tuple(Upstream(module, f"{prefix}{name}", OUTPUT_SIGNATURE, OUTPUT_SHA)
                                 for name in ("SelfOutput", "Output")))


register_family(bert_like("bert", "bert", "Bert", "e444e7233b5a9365"))
register_family(bert_like("roberta", "roberta", "Roberta", "cf121e5129e46c09"))
register_family(bert_like("xlm-roberta", "xlm_roberta", "XLMRoberta", "e5d8a974ce95fa8a"))
register_family(bert_like("electra", "electra", "Electra", "e444e7233b5a9365"))

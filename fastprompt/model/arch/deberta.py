"""DeBERTa-v2/v3: refused for prefix prompts. Its disentangled attention adds content-to-position and
position-to-content terms computed from the relative positions of query and key; a prefix key has no position, so
those terms are undefined for the prefix columns, and its attention modules are not reached by transformers'
attention functions: the guard stops a prefix at the first forward. Soft input tokens (``prompt_type="input"``)
work, and its output modules get the fused dropout + add + LayerNorm like BERT's.
"""
from __future__ import annotations

from .family import Family, Upstream, register_family

MODULE = "transformers.models.deberta_v2.modeling_deberta_v2"
OUTPUTS = tuple(Upstream(MODULE, name, "(self, hidden_states, input_tensor)", "f513a4ade82252d1")
                for name in ("DebertaV2SelfOutput", "DebertaV2Output"))

register_family(Family(
    "deberta-v2", "DeBERTa-v2/v3", attention="bypassed", add_norm=OUTPUTS, prefix="refused", compared=("AutoModel",),
    refused="its disentangled attention's position terms are undefined for a prefix key (which has no position), "
            "and its attention modules do not go through transformers' attention functions"))

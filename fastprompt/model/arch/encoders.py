"""Encoders that need nothing but the registered attention function: DistilBERT (its attention modules carry no
``layer_idx``: the layer is found from the backbone's layer list) and ModernBERT (RoPE: the prefix keys are used as
keys already rotated; its local layers' bidirectional sliding window applies to the token block, the prefix stays
visible to every token; its unpadded path is fastprompt's packed batch). PEFT's prefix tuning runs on neither.
"""
from __future__ import annotations

from .family import Family, register_family

register_family(Family(
    "distilbert", "DistilBERT", packs=True, onnx=True, lora_targets=("q_lin", "k_lin", "v_lin", "out_lin"),
    peft="PEFT cannot size its prefix (DistilBertConfig has no hidden_size: 'Please specify token_dim') and "
         "DistilBERT takes no key/value cache"))
register_family(Family(
    "modernbert", "ModernBERT", packs=True, onnx=True, lora_targets=("Wqkv", "Wo"),
    ffn_matrices=3,  # its gated Wi is H x 2F
    peft="ModernBERT does not take PEFT's key/value cache (its mask keeps the token length: a size mismatch at the "
         "first forward)"))

"""Decoder-only models: Llama-like (Llama, Mistral, Qwen2, Qwen3) and Gemma (Gemma, Gemma 2, Gemma 3 text). All
call transformers' attention functions, so the prefix enters through the registered one: one prefix key/value per
key/value head (grouped-query attention), the token block causal and the prefix visible to every token, the prefix
keys used as keys already rotated by RoPE, sliding windows on the token block only. They pool ``last`` or ``mean``
(a causal model's first token sees no other). PEFT's prefix tuning runs on all; where a sliding window hides its
prefix from distant tokens (Mistral, Gemma 2/3) it is not compared. Gemma 2 caps its attention scores, which the
fused op does not compute: a prefix on such a layer is refused (prefix_attention_forward says so). Their
feed-forward is gated (gate, up, down: three matrices).
"""
from __future__ import annotations

from dataclasses import replace

from .family import Family, register_family

POOLING = "last, mean"
WITH_PEFT = ("explicit concatenation", "AutoModel", "PEFT")
LORA = ("q_proj", "k_proj", "v_proj", "o_proj")
LLAMA = Family("llama", "Llama-like decoders", packs=True, pooling=POOLING, compared=WITH_PEFT, ffn_matrices=3,
               lora_targets=LORA, onnx=True)
GEMMA = Family("gemma", "Gemma", packs=True, pooling=POOLING, compared=WITH_PEFT, ffn_matrices=3, lora_targets=LORA,
               onnx=True)

register_family(LLAMA)
register_family(replace(LLAMA, model_type="mistral", compared=("explicit concatenation", "AutoModel")))
register_family(replace(LLAMA, model_type="qwen2"))
register_family(replace(LLAMA, model_type="qwen3"))
register_family(GEMMA)
register_family(replace(GEMMA, model_type="gemma2", prefix="supported without score soft-capping",
                        compared=("explicit concatenation", "AutoModel")))
register_family(replace(GEMMA, model_type="gemma3_text", compared=("explicit concatenation", "AutoModel")))

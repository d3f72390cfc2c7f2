"""A tiny bidirectional encoder of a model type transformers does not know (``fastprompt-toy``), written the way
transformers writes its models: attention through ``ALL_ATTENTION_FUNCTIONS`` (keywords passed down, a
``layer_idx`` on each attention module), the mask from ``create_bidirectional_mask``, position ids from the
caller when given, and a BERT-style output module (dense -> dropout -> LayerNorm(h + input)) closing each
block. Importing it registers the type with AutoConfig and AutoModel."""
from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

MODEL_TYPE = "fastprompt-toy"


class ToyConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(self, vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1, layer_norm_eps=1e-12,
                 initializer_range=0.02, pad_token_id=0, **kwargs):
        super().__init__(pad_token_id=pad_token_id, **kwargs)
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
        self.max_position_embeddings, self.hidden_dropout_prob = max_position_embeddings, hidden_dropout_prob
        self.layer_norm_eps, self.initializer_range = layer_norm_eps, initializer_range


class ToyAttention(nn.Module):
    def __init__(self, config: ToyConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, False
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.q, self.k, self.v = (nn.Linear(config.hidden_size, config.hidden_size) for _ in range(3))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        B, S, _ = hidden_states.shape
        q, k, v = (lin(hidden_states).view(B, S, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        attend = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attend(self, q, k, v, attention_mask, scaling=self.scaling, dropout=0.0, **kwargs)
        return out.reshape(B, S, -1)


class ToyOutput(nn.Module):
    def __init__(self, config: ToyConfig, width: int):
        super().__init__()
        self.dense = nn.Linear(width, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class ToyLayer(nn.Module):
    def __init__(self, config: ToyConfig, layer_idx: int):
        super().__init__()
        self.attention = ToyAttention(config, layer_idx)
        self.attention_output = ToyOutput(config, config.hidden_size)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = ToyOutput(config, config.intermediate_size)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        hidden_states = self.attention_output(self.attention(hidden_states, attention_mask, **kwargs), hidden_states)
        return self.output(nn.functional.gelu(self.intermediate(hidden_states)), hidden_states)


class ToyModel(PreTrainedModel):
    config_class = ToyConfig
    base_model_prefix = "toy"
    _supports_attention_backend = True
    _supports_sdpa = True

    def __init__(self, config: ToyConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(ToyLayer(config, i) for i in range(config.num_hidden_layers))
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                token_type_ids=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if position_ids is None:
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        hidden = inputs_embeds + self.position_embeddings(position_ids)
        mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, mask, **kwargs)
        return BaseModelOutput(last_hidden_state=hidden)


AutoConfig.register(MODEL_TYPE, ToyConfig, exist_ok=True)
AutoModel.register(ToyConfig, ToyModel, exist_ok=True)

"""PromptConfig: every choice that defines the trainable prompt, serialised into checkpoints.

Standard library only (no torch), so a training config that owns one validates before any model loads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from fastprompt.choices import INIT_MODES, POSITION_MODES, PROMPT_TYPES
from fastprompt.fields import Section, option
from fastprompt.messages import shown

__all__ = ["PromptConfig", "INIT_MODES", "POSITION_MODES"]


@dataclass
class PromptConfig(Section):
    """The trainable prompt: its shape, parameterisation, initialisation and token positions.

    The hyper-parameters of :class:`~fastprompt.model.PrefixPrompt`; each field's help text documents it.
    ``prefix_projection`` is PromCSE/DCPCSE's reparameterisation: Embedding(P, hidden) ->
    Linear(hidden, projection_hidden_size) -> Tanh -> Linear(.., 2*layers*hidden). ``init="vocab"`` uses the
    frozen backbone's own per-layer keys/values of P random vocabulary tokens (a data-free warm start) and
    ignores ``init_std`` (for input soft tokens: the static embeddings of random vocabulary tokens).
    ``input_layer_only`` is PromCSE's ablation: keys/values that layer 0 attends to, not tokens that travel up
    through the layers; soft tokens that do are ``prompt_type="input"``.
    """

    prompt_length: int = option(16, "prefix positions P per layer (P-tuning v2's pre_seq_len)", ge=1, identity=True)
    prompt_type: str = option("prefix", "deep prompts: trainable keys/values in every attention layer (prefix), "
                              "soft tokens in the input sequence that pass through every layer (input: prompt "
                              "tuning, the papers' shallow-prompt ablation), both, or none (LoRA or full "
                              "fine-tuning alone: needs lora or train_backbone)", choices=PROMPT_TYPES,
                              identity=True)
    input_prompt_length: int = option(16, "soft input tokens inserted right after [CLS] (prompt_type input/both)",
                                      ge=0, identity=True)
    optiprompt: bool = option(False, "the template's words become trainable vectors initialised from their static "
                              "embeddings (PromptBERT's OptiPrompt; needs a template)", identity=True)
    prefix_projection: bool = option(False, "reparameterise the prefix through an MLP (PromCSE/DCPCSE)", identity=True)
    projection_hidden_size: int = option(512, "width of the prefix_projection MLP", ge=1, identity=True)
    shared_across_layers: bool = option(False, "one prefix shared by every layer (PromCSE's ablation)", identity=True)
    input_layer_only: bool = option(False, "a prefix that only the first attention layer attends to (PromCSE's "
                                    "input-layer-only ablation); for soft tokens that travel up every layer, "
                                    "use prompt_type: input", identity=True)
    cls_prompt: bool = option(False, "a trainable vector replaces the [CLS] token embedding (D2CSE)", identity=True)
    prompt_dropout: float = option(0.0, "dropout on the prefix key/values (P-tuning v2: the hidden dropout)",
                                   ge=0.0, lt=1.0, identity=False)
    init: str = option("normal", "prompt initialisation: N(0, init_std), U(-init_std, init_std), or vocabulary "
                       "tokens' keys/values", choices=INIT_MODES, key="prompt_init", identity=True)
    init_std: float = option(0.02, "scale of the normal/uniform initialisation (> 0: zero would start every "
                             "prefix position identical)", gt=0.0, identity=True)
    position_mode: str = option("standard", "token positions 0..S-1 (standard) or P..P+S-1 (shifted: the "
                                "original PromCSE/DCPCSE code)", choices=POSITION_MODES, identity=True)

    def validate(self) -> "PromptConfig":
        super().validate()
        if self.shared_across_layers and self.input_layer_only:
            raise ValueError("shared_across_layers and input_layer_only are mutually exclusive")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PromptConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a prompt config must be a mapping of PromptConfig fields, got {shown(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ValueError(f"unknown PromptConfig keys: {shown(unknown)}")
        return cls(**data)

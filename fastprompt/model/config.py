"""PromptConfig: every choice that defines the trainable prompt, serialised into checkpoints."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from fastprompt.choices import INIT_MODES, POSITION_MODES, PROMPT_TYPES


@dataclass
class PromptConfig:
    """Hyper-parameters of :class:`~fastprompt.model.PrefixPrompt`.

    Attributes:
        prompt_type: "prefix" (deep prompts: trainable keys/values in every attention layer), "input" (soft
            tokens: trainable vectors in the input embedding sequence, which pass through every layer: prompt
            tuning, the papers' shallow-prompt ablation) or "both".
        prompt_length: number of prefix positions P per layer (P-tuning v2's ``pre_seq_len``); prefix only.
        input_prompt_length: number of soft input tokens (inserted right after [CLS]); may be 0.
        optiprompt: the template's words become trainable vectors initialised from their static token
            embeddings (PromptBERT's OptiPrompt); needs a template.
        prefix_projection: reparameterise the prefix through an MLP
            (Embedding(P, hidden) -> Linear(hidden, projection_hidden_size) -> Tanh -> Linear(.., 2*layers*hidden)),
            as PromCSE/DCPCSE's ``prefix_projection``.
        projection_hidden_size: width of that MLP.
        shared_across_layers: one prefix shared by every layer (PromCSE's layer-shared ablation).
        input_layer_only: a *prefix* on the first attention layer only (PromCSE's "input-layer-only" ablation):
            keys/values that layer 0 attends to, not tokens that travel up through the layers; soft tokens
            that do are ``prompt_type="input"``.
        cls_prompt: a trainable vector replaces the [CLS] token embedding (D2CSE's "[CLS] prompt").
        prompt_dropout: dropout on the prefix key/values (P-tuning v2 uses the backbone's hidden dropout).
        init: "normal" (N(0, init_std)), "uniform" (U(-init_std, init_std)), or "vocab": the frozen backbone's
            own per-layer keys/values of P random vocabulary tokens (a data-free warm start); for input soft
            tokens, the static embeddings of random vocabulary tokens.
        init_std: scale of the random initialisations.
        position_mode: "standard" keeps token positions 0..S-1; "shifted" reproduces the original
            PromCSE/DCPCSE code (transformers 4.2.1), where tokens sat at positions P..P+S-1.
    """

    prompt_length: int = 16
    prompt_type: str = "prefix"
    input_prompt_length: int = 16
    optiprompt: bool = False
    prefix_projection: bool = False
    projection_hidden_size: int = 512
    shared_across_layers: bool = False
    input_layer_only: bool = False
    cls_prompt: bool = False
    prompt_dropout: float = 0.0
    init: str = "normal"
    init_std: float = 0.02
    position_mode: str = "standard"

    def __post_init__(self):
        if not isinstance(self.prompt_length, int) or self.prompt_length < 1:
            raise ValueError(f"prompt_length must be a positive integer, got {self.prompt_length!r}")
        if self.prompt_type not in PROMPT_TYPES:
            raise ValueError(f"prompt_type must be one of {PROMPT_TYPES}, got {self.prompt_type!r}")
        if not isinstance(self.input_prompt_length, int) or self.input_prompt_length < 0:
            raise ValueError(f"input_prompt_length must be a non-negative integer, got {self.input_prompt_length!r}")
        if self.projection_hidden_size < 1:
            raise ValueError(f"projection_hidden_size must be positive, got {self.projection_hidden_size}")
        if self.shared_across_layers and self.input_layer_only:
            raise ValueError("shared_across_layers and input_layer_only are mutually exclusive")
        if not 0.0 <= self.prompt_dropout < 1.0:
            raise ValueError(f"prompt_dropout must be in [0, 1), got {self.prompt_dropout}")
        if self.init not in INIT_MODES:
            raise ValueError(f"init must be one of {INIT_MODES}, got {self.init!r}")
        if self.init_std <= 0:
            raise ValueError(f"init_std must be positive, got {self.init_std}")
        if self.position_mode not in POSITION_MODES:
            raise ValueError(f"position_mode must be one of {POSITION_MODES}, got {self.position_mode!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PromptConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown PromptConfig keys: {sorted(unknown)}")
        return cls(**data)

"""PrefixPrompt: the trainable per-layer prefix keys/values (the only prompt weights of deep prompt tuning)."""
from __future__ import annotations

import torch
from torch import nn

from .attention import check_prefix_consumed
from .config import PromptConfig
from .device import check_allocation
from .soft_prompt import random_vocab_ids


class PrefixPrompt(nn.Module):
    """Per-layer prefix key/values, stored once with shape (layers, 2, heads, P, head_dim).

    The prefix is not expanded over the batch: :meth:`forward` returns the stored tensor (or the output of
    the reparameterisation MLP) and attention broadcasts it. The one exception is prompt dropout in
    training: as in P-tuning v2 / DCPCSE (``get_prompt`` expands the prefix over the batch, then applies
    dropout), every example (every row, so every view) draws its own mask, so the prefix is expanded to
    (batch, ...) before dropout; that costs batch x the prefix's size in activations (bert-base, P=16, 512
    rows: ~300 MB fp32) and only happens when ``prompt_dropout > 0``. ``layers`` is 1 when the prompt is
    shared across layers or on the input layer only; :meth:`layer_prefixes` maps it onto every layer.
    """

    def __init__(self, config: PromptConfig, num_layers: int, num_heads: int, head_dim: int):
        super().__init__()
        self.config = config
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.stored_layers = 1 if (config.shared_across_layers or config.input_layer_only) else num_layers
        P, hidden = config.prompt_length, num_heads * head_dim
        # checked before allocating (prompt_length=1e9 failed inside torch): a prompt is made to be trained, so its
        # weights count with their gradient and AdamW's two moments
        check_allocation(4 * self.bytes_needed(config, self.stored_layers, hidden),
                         f"prompt_length={P} (a prefix of {self.stored_layers} layers x 2 x {P} positions x {hidden}, "
                         "with its gradient and AdamW moments)", "deep prompts use a few positions (the papers: 10 "
                         "to 32)")
        if config.prefix_projection:
            # PromCSE / P-tuning v2 "prefix_projection": a reparameterisation that is trained and then
            # could be folded away; it makes optimisation smoother on large backbones.
            self.embedding = nn.Embedding(P, hidden)
            self.projection = nn.Sequential(
                nn.Linear(hidden, config.projection_hidden_size),
                nn.Tanh(),
                nn.Linear(config.projection_hidden_size, self.stored_layers * 2 * hidden),
            )
            self.register_buffer("prefix_tokens", torch.arange(P), persistent=False)
        else:
            self.prefix = nn.Parameter(torch.empty(self.stored_layers, 2, num_heads, P, head_dim))
        self.dropout = nn.Dropout(config.prompt_dropout)
        self.reset_parameters()

    @staticmethod
    def bytes_needed(config: PromptConfig, stored_layers: int, hidden: int) -> int:
        """The prompt's parameters and the evaluated prefix (every forward materialises it), in the default dtype."""
        P, prefix = config.prompt_length, stored_layers * 2 * hidden * config.prompt_length
        params = prefix
        if config.prefix_projection:
            width = config.projection_hidden_size
            params = P * hidden + (hidden + 1) * width + (width + 1) * stored_layers * 2 * hidden + prefix
        return params * torch.get_default_dtype().itemsize

    def reset_parameters(self):
        std = self.config.init_std
        tensors = [self.embedding.weight] if self.config.prefix_projection else [self.prefix]
        for t in tensors:
            if self.config.init == "uniform":
                nn.init.uniform_(t, -std, std)
            else:  # "normal"; "vocab" is applied afterwards (init_prefix_from_vocab), which needs the backbone
                nn.init.normal_(t, std=std)

    @torch.no_grad()
    def load_prefix_(self, prefix: torch.Tensor):
        """Overwrite the stored prefix (used by the ``vocab`` initialisation). Not for projected prompts."""
        if self.config.prefix_projection:
            raise ValueError("load_prefix_ is not defined for a reparameterised (prefix_projection) prompt")
        if prefix.shape != self.prefix.shape:
            raise ValueError(f"prefix shape {tuple(prefix.shape)} != {tuple(self.prefix.shape)}")
        self.prefix.copy_(prefix)

    @property
    def prompt_length(self) -> int:
        return self.config.prompt_length

    def forward(self, batch_size: int | None = None) -> torch.Tensor:
        """The prefix, shape (stored_layers, 2, heads, P, head_dim), with prompt dropout applied.

        With ``batch_size``, in training with ``prompt_dropout > 0``: (batch_size, stored_layers, 2, heads, P,
        head_dim), an independent dropout mask per example.
        """
        if self.config.prefix_projection:
            flat = self.projection(self.embedding(self.prefix_tokens))  # (P, stored_layers*2*hidden)
            P = self.config.prompt_length
            prefix = flat.view(P, self.stored_layers, 2, self.num_heads, self.head_dim).permute(1, 2, 3, 0, 4)
        else:
            prefix = self.prefix
        if batch_size is not None and self.training and self.dropout.p > 0:
            prefix = prefix.unsqueeze(0).expand(batch_size, *prefix.shape)
        return self.dropout(prefix)

    def layer_prefixes(self, prefix: torch.Tensor | None = None, batch_size: int | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """(key, value) of shape (heads, P, head_dim) for each backbone layer, or None where it has no prefix;
        (batch_size, heads, P, head_dim) when :meth:`forward` gave each example its own dropout mask."""
        prefix = self.forward(batch_size) if prefix is None else prefix
        if prefix.dim() == 6:  # (batch, layers, 2, heads, P, head_dim)
            prefix = prefix.movedim(0, 2)  # (layers, 2, batch, heads, P, head_dim)
        if self.config.input_layer_only:
            return [(prefix[0, 0], prefix[0, 1])] + [None] * (self.num_layers - 1)
        if self.config.shared_across_layers:
            return [(prefix[0, 0], prefix[0, 1])] * self.num_layers
        return [(prefix[i, 0], prefix[i, 1]) for i in range(self.num_layers)]

    def extra_repr(self) -> str:
        c = self.config
        return (f"layers={self.num_layers}, heads={self.num_heads}, P={c.prompt_length}, head_dim={self.head_dim}, "
                f"projection={c.prefix_projection}, shared={c.shared_across_layers}, input_only={c.input_layer_only}")


@torch.no_grad()
def init_prefix_from_vocab(encoder) -> None:
    """The ``vocab`` initialisation of a :class:`~fastprompt.model.PromptEncoder`'s prefix: the frozen backbone's
    own keys/values of P random non-special vocabulary tokens, captured from its attention function."""
    if encoder.prompt_config.prefix_projection:
        raise ValueError("init='vocab' is not defined for a reparameterised (prefix_projection) prompt")
    if encoder.prefix_mode != "attention":
        raise ValueError("init='vocab' needs prefix_mode='attention'")
    pick = random_vocab_ids(encoder.tokenizer, encoder.prompt_length).unsqueeze(0).to(encoder.device)
    capture, saved = {}, (encoder.prompt, encoder.input_prompt, encoder.template_words)
    encoder.prompt = encoder.input_prompt = encoder.template_words = None  # run the plain backbone
    try:
        encoder.hidden_states(pick, torch.ones_like(pick), _capture=capture)
    finally:
        encoder.prompt, encoder.input_prompt, encoder.template_words = saved
    prompt = encoder.prompt
    check_prefix_consumed(range(prompt.stored_layers), capture, encoder.architecture.name)
    per_layer = [torch.stack(capture[i]) for i in range(prompt.stored_layers)]  # (2, H, P, D) each
    prompt.load_prefix_(torch.stack(per_layer).to(prompt.prefix.dtype))

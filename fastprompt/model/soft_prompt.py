"""Input-level prompts: trainable vectors in the input embedding sequence, which pass through every layer.

- :class:`InputPrompt` (``prompt_type="input"`` or ``"both"``): ``n`` vectors inserted right after the first
  token ([CLS] / <s>), as prompt tuning / P-tuning and the shallow-prompt ablations of DCPCSE and PromCSE. The
  first token stays first, so the [CLS] pooler is unchanged; the encoder drops the vectors' output states, so
  every pooler and token-level head sees states aligned with the input ids.
- The [CLS] prompt (D2CSE, ``cls_prompt=True``): one trainable vector that replaces the first token's embedding
  (:func:`cls_prompt_parameter`, :func:`replace_first_token`).

The per-layer prefix is :class:`~fastprompt.model.prefix.PrefixPrompt`; OptiPrompt's trainable template words are
PromptBERT's (:class:`~fastprompt.model.promptbert.TemplateWords`).
"""
from __future__ import annotations

import torch
from torch import nn


def random_vocab_ids(tokenizer, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` random non-special token ids (the data-free "vocab" initialisation)."""
    special = set(tokenizer.all_special_ids)
    candidates = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    return candidates[torch.randperm(len(candidates), generator=generator)[:n]]


class InputPrompt(nn.Module):
    """``length`` trainable input embeddings, shape (length, hidden); ``length`` may be 0 (the plain model)."""

    def __init__(self, length: int, hidden_size: int):
        super().__init__()
        self.length = length
        self.embedding = nn.Parameter(torch.empty(length, hidden_size))

    @torch.no_grad()
    def reset_parameters(self, init: str, std: float, word_embeddings: torch.Tensor | None = None, tokenizer=None):
        """``normal``/``uniform`` with scale ``std``, or ``vocab``: the static embeddings of random tokens."""
        if init == "vocab":
            ids = random_vocab_ids(tokenizer, self.length).to(word_embeddings.device)
            self.embedding.copy_(word_embeddings[ids])
        elif init == "uniform":
            nn.init.uniform_(self.embedding, -std, std)
        else:
            nn.init.normal_(self.embedding, std=std)

    def insert(self, embeds: torch.Tensor) -> torch.Tensor:
        """(B, S, hidden) -> (B, S + length, hidden): the vectors right after the first token."""
        if self.length == 0:
            return embeds
        soft = self.embedding.to(embeds.dtype).unsqueeze(0).expand(embeds.shape[0], -1, -1)
        return torch.cat([embeds[:, :1], soft, embeds[:, 1:]], dim=1)

    def remove(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, S + length, hidden) -> (B, S, hidden): drop the vectors' output states."""
        if self.length == 0:
            return hidden
        return torch.cat([hidden[:, :1], hidden[:, 1 + self.length:]], dim=1)

    def insert_mask(self, mask: torch.Tensor, fill: int = 1) -> torch.Tensor:
        """(B, S) -> (B, S + length): a column per vector (attention mask ones; ``fill=0`` for token type ids)."""
        if self.length == 0:
            return mask
        soft = mask.new_full((mask.shape[0], self.length), fill)
        return torch.cat([mask[:, :1], soft, mask[:, 1:]], dim=1)

    def insert_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """(B, S) -> (B, S + length): the vectors take positions 1..length, the text after them moves by length."""
        n = self.length
        soft = torch.arange(1, n + 1, device=positions.device).expand(positions.shape[0], -1)
        return torch.cat([positions[:, :1], soft, positions[:, 1:] + n], dim=1)


def cls_prompt_parameter(tokenizer, word_embeddings: torch.Tensor) -> nn.Parameter:
    """The [CLS] prompt, initialised from the embedding of the token it replaces.

    The tokenizer must put its [CLS] (or BOS) token first in every row; otherwise the prompt would replace a word,
    or a padding token that attention never reads."""
    cls_id = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    first = tokenizer("a")["input_ids"][:1]
    if cls_id is None or first != [cls_id]:
        raise ValueError("cls_prompt replaces the [CLS] token at the start of every input, but "
                         f"{type(tokenizer).__name__} does not start its inputs with a [CLS] or BOS token: there is "
                         "no such token to replace")
    if getattr(tokenizer, "padding_side", "right") == "left":
        raise ValueError("cls_prompt replaces the first token of every row, which under left padding is a padding "
                         "token that attention never reads; use a right-padding tokenizer (tokenizer.padding_side "
                         "= 'right')")
    return nn.Parameter(word_embeddings[cls_id].detach().clone())


def replace_first_token(embeds: torch.Tensor, cls_prompt: torch.Tensor) -> torch.Tensor:
    """(B, S, hidden) input embeddings with the first column replaced by the [CLS] prompt."""
    cls = cls_prompt.to(embeds.dtype).expand(embeds.shape[0], 1, -1)
    return torch.cat([cls, embeds[:, 1:]], dim=1)

"""The small result and argument types the ops and their references share (torch only, no op imported), so that
``reference.py`` and the op modules both build on them instead of one importing the other."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class ContrastiveStats(NamedTuple):
    """Per-anchor statistics of :func:`fastprompt.ops.contrastive_loss` (detached): (N,) each, or (N, D) with
    ``matryoshka_dims`` (column t for ``matryoshka_dims[t]``). ``hardest_neg_index`` indexes the columns
    ``cat(z2, z3[0], ..., z3[k-1])`` (-1 where every negative was masked)."""

    lse: torch.Tensor  # log-sum-exp of the anchor's logits (bias, hardness penalty and masks included)
    pos_sim: torch.Tensor  # cosine with its positive
    hardest_neg_sim: torch.Tensor  # largest cosine over the other columns left in the softmax
    hardest_neg_index: torch.Tensor  # int64 column index of that negative
    lse_sym: Optional[torch.Tensor] = None  # the reverse term's log-sum-exp per positive (symmetric only)


class Guide(NamedTuple):
    """A guide model's embeddings of the same texts (GISTEmbed): they score the ``fn_margin`` false-negative
    mask of :func:`fastprompt.ops.contrastive_loss`. Rows as the op's arguments: ``z1`` (N, dg), ``z2`` (M2, dg),
    ``z3`` like the op's z3 (with dg), and ``reverse_columns`` when the op has them. No gradient flows into them."""

    z1: torch.Tensor
    z2: torch.Tensor
    z3: Optional[torch.Tensor] = None
    reverse_columns: Optional[torch.Tensor] = None

"""SimCSE's InfoNCE: cosine similarity / temperature over in-batch negatives.

Unsupervised: the two views of a row are the same sentence under two dropout masks. Supervised: the
entailment hypothesis is the positive and, for triplets, the contradiction (the view named ``hard_neg``) is
an extra column (a hard negative) whose logit gets ``hard_negative_weight`` added (the log of SimCSE's
weight; 0 = weight 1). The loss itself is :func:`fastprompt.ops.contrastive_loss` (fused kernels or the
reference, chosen by ``backend``), so this module only maps views to the op's arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fastprompt.data.corpus import is_negative_column
from fastprompt.objectives.base import HARD_NEGATIVE_VIEW, SKI_VIEW, ObjectiveOutput, SentenceObjective, Views
from fastprompt.objectives.config import OBJECTIVE_REGISTRY, objective_default
from fastprompt.ops import contrastive_loss


def split_views(views: Views) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Local anchors (view 0), gathered positives (view 1) and gathered hard negatives: the ``hard_neg`` view
    (B_global, H), k >= 2 views ``hard_neg``, ``hard_neg_2``, ... as one (k, B_global, H) block (the view-major
    layout makes it a slice, no copy), or None."""
    n = len(views.names)
    if n < 2 or not all(is_negative_column(v) for v in views.names[2:]):
        raise ValueError(f"simcse needs the views anchor, positive and k >= 0 negatives ({HARD_NEGATIVE_VIEW}, "
                         f"{HARD_NEGATIVE_VIEW}_2, ...), got {n}: {views.names}")
    if n == 2 and views.gathered.shape[1] < 2:
        raise ValueError("a batch of one pair has no in-batch negative: use batch_size >= 2")
    z3 = None if n == 2 else views.gathered[2] if n == 3 else views.gathered[2:]
    return views.local[0], views.gathered[1], z3


@dataclass
class SimCSE(SentenceObjective):
    """InfoNCE over cosine similarities (SimCSE / DCPCSE). ``hinge_weight`` > 0 adds PromCSE's L_EH."""

    temperature: float = objective_default("temperature")
    hard_negative_weight: float = objective_default("hard_negative_weight")
    hinge_margin: float = objective_default("hinge_margin")
    hinge_weight: float = OBJECTIVE_REGISTRY["simcse"].default_hinge_weight
    backend: str = objective_default("backend")
    #: sentence-transformers' hardness weighting: which negatives get ``hardness_strength * stop_grad(cos)`` added
    hardness_mode: str | None = None
    hardness_strength: float = 0.0
    #: GISTEmbed's false-negative margin, scored by the model's own cosines (absolute or relative)
    fn_margin: float | None = None
    fn_margin_strategy: str = "absolute"
    #: Matryoshka: the loss summed over these re-normalised prefixes of the embedding (weights default to 1)
    matryoshka_dims: tuple[int, ...] | None = None
    matryoshka_weights: tuple[float, ...] | None = None

    name = "simcse"
    description = "InfoNCE over in-batch negatives (SimCSE objective, as DCPCSE)"
    citation = """@inproceedings{gao2021simcse,
  title = {{SimCSE}: Simple Contrastive Learning of Sentence Embeddings},
  author = {Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},
  booktitle = {Empirical Methods in Natural Language Processing (EMNLP)},
  year = {2021}
}"""

    @property
    def stat_names(self) -> tuple[str, ...]:
        return ("pos_cos", "hard_neg_cos", "acc") + (("loss_cl", "loss_eh") if self.hinge_weight else ())

    def views_for(self, columns: tuple[str, ...]) -> tuple[str, ...]:
        """As the base class, leaving out a ``ski`` column (only objective=skicse reads the SKI)."""
        return super().views_for(tuple(c for c in columns if c != SKI_VIEW))

    def loss(self, views: Views) -> ObjectiveOutput:
        z1, z2, z3 = split_views(views)
        column_ids = views.ids[1:].reshape(-1) if views.ids is not None else None
        return self.from_views(z1, z2, z3, positive_offset=views.positive_offset, column_ids=column_ids)

    def loss_options(self) -> dict:
        """The fused loss's options this objective sets (only those: the op's defaults stay its own)."""
        options = {}
        if self.hardness_mode is not None:
            options.update(hardness_mode=self.hardness_mode, hardness_strength=self.hardness_strength)
        if self.fn_margin is not None:
            options.update(fn_margin=self.fn_margin, fn_margin_strategy=self.fn_margin_strategy)
        if self.matryoshka_dims:
            options["matryoshka_dims"] = list(self.matryoshka_dims)
            if self.matryoshka_weights:
                options["matryoshka_weights"] = list(self.matryoshka_weights)
        return options

    def from_views(self, z1: torch.Tensor, z2: torch.Tensor, z3: torch.Tensor | None = None, *,
                   positive_offset: int = 0, column_ids: torch.Tensor | None = None) -> ObjectiveOutput:
        """Loss from anchors/positives/hard negatives. ``z2``/``z3`` may hold more rows than ``z1`` (columns
        gathered from other processes), with the positives at ``z2[positive_offset:positive_offset+len(z1)]``;
        ``z3`` is (M, d) (one negative per row) or (k, M, d). ``column_ids``: the text ids of the columns
        ``cat(z2, z3...)`` (a column with its anchor's positive's id, or a negative id, leaves the softmax)."""
        options = self.loss_options()
        if column_ids is not None:
            options["column_ids"] = column_ids
        # check_finite=False: a non-finite embedding must give a non-finite loss that the trainer skips,
        # not an exception in the middle of a step.
        loss, st = contrastive_loss(
            z1, z2, z3, temperature=self.temperature, hard_negative_weight=self.hard_negative_weight,
            hinge_margin=self.hinge_margin, hinge_weight=self.hinge_weight, positive_offset=positive_offset,
            backend=self.backend, return_stats=True, check_finite=False, **options,
        )
        # per Matryoshka dimension (columns of the stats) weighted as the loss weighs them; one column without.
        # The statistics stay on the device (the trainer reads them at its log rows).
        per_dim = torch.relu(self.hinge_margin + st.hardest_neg_sim - st.pos_sim).reshape(len(z1), -1).mean(0)
        weights = self.matryoshka_weights or [1.0] * per_dim.shape[0]
        hinge = sum(w * per_dim[t] for t, w in enumerate(weights)).detach()
        stats = {
            "pos_cos": st.pos_sim.mean().detach(),
            "hard_neg_cos": st.hardest_neg_sim.mean().detach(),
            # in-batch top-1 accuracy: the positive beats every other column
            "acc": (st.pos_sim > st.hardest_neg_sim).float().mean(),
        }
        if self.hinge_weight:
            stats["loss_eh"] = hinge
            stats["loss_cl"] = loss.detach() - self.hinge_weight * hinge
        return ObjectiveOutput(loss, stats)

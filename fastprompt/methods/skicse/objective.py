"""SKICSE: a sentence's "sentence knowable information" (SKI, generated offline by an LLM) as an extra positive.

The SKI is one more view of each row, named ``ski`` (see ``docs/ski.md`` for the data layouts). With ``h_i``
the anchor (view 0, ``sent0``), ``h_i'`` its second dropout view, ``k_i`` its SKI (the paper's ``h_i^ski``),
and for NLI rows ``h_i+`` the entailment and ``h_i-`` the contradiction, the terms are the paper's equations
(SKICSE, Ou & Xu, section 3.2), each an in-batch InfoNCE over cosine / temperature with columns gathered over
every process, computed by :func:`fastprompt.ops.contrastive_loss`:

Unsupervised (``sent0,ski`` rows; views ``sent0, sent0, ski``)::

    L = (1 - λ) L_simcse + λ L_ski                      λ = ski_weight (0.15)         Eq. 3
    L_simcse: anchor h_i, positive h_i', columns {h_j'}                               Eq. 1
    L_ski:    anchor h_i, positive k_i,  columns {k_j}                                Eq. 2

Supervised (``sent0,sent1,hard_neg,ski`` rows)::

    L = (1 - λ1 - λ2) L_sup + λ1 L_ski1 + λ2 L_ski2      λ1 = ski1_weight (0.1), λ2 = ski2_weight (0.3)   Eq. 7
    L_sup:  anchor h_i, positive h_i+, columns {h_j+} ∪ {h_j-}                                          Eq. 4
    L_ski1: anchor k_i, positive h_i+, columns {h_j+} ∪ {h_j-}    (the SKI entails the hypothesis)      Eq. 5
    L_ski2: anchor h_i, positive k_i,  columns {h_j+} ∪ {h_j-}    (Eq. 6 as printed)                    Eq. 6

Eq. 6 as printed has its positive ``k_i`` in the numerator but not among its denominator's columns, so it is
not a ``-log softmax`` (it may go below 0): ``L_ski2 = L_sup + (cos(h_i, h_i+) - cos(h_i, k_i)) / τ``, which
is how it is computed (the denominator is L_sup's). ``ski2_denominator="ski"`` is the other reading, an
explicit option: columns ``{k_j}``, i.e. Eq. 2's form (the printed denominator may be Eq. 4's copied); see
``docs/ski.md``. ``hard_negative_weight`` applies to every denominator with contradiction columns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from fastprompt.choices import SKI2_DENOMINATORS, check_choice
from fastprompt.methods.skicse.config import check_ski_weights, ski_default
from fastprompt.objectives.base import HARD_NEGATIVE_VIEW, SKI_VIEW, ObjectiveOutput, SentenceObjective, Views
from fastprompt.objectives.config import objective_default
from fastprompt.ops import contrastive_loss


@dataclass
class SKICSE(SentenceObjective):
    """(1 - λ) L_simcse + λ L_ski (unsupervised) or (1 - λ1 - λ2) L_sup + λ1 L_ski1 + λ2 L_ski2 (supervised)."""

    temperature: float = objective_default("temperature")
    hard_negative_weight: float = objective_default("hard_negative_weight")
    ski_weight: float = ski_default("ski_weight")
    ski1_weight: float = ski_default("ski1_weight")
    ski2_weight: float = ski_default("ski2_weight")
    ski2_denominator: str = ski_default("ski2_denominator")
    backend: str = objective_default("backend")

    name = "skicse"
    description = ("InfoNCE + contrastive terms between each sentence and the knowledge an LLM states about it "
                   "(SKICSE)")
    citation = """@misc{ou2024skicse,
  title = {{SKICSE}: Sentence Knowable Information Prompted by {LLMs} Improves Contrastive Sentence Embeddings},
  author = {Ou, Fangwei and Xu, Jinan},
  year = {2024}
}"""
    # loss_ski is L_ski (unsupervised) or L_ski1 (Eq. 5); loss_ski2 (Eq. 6) is left empty in unsupervised runs.
    # ski_cos: mean cos(h_i, k_i) of each sentence and its SKI.
    stat_names = ("pos_cos", "hard_neg_cos", "acc", "loss_cl", "loss_ski", "ski_cos", "loss_ski2")

    def __post_init__(self):
        check_ski_weights(self.ski_weight, self.ski1_weight, self.ski2_weight)
        check_choice("ski2_denominator", self.ski2_denominator, SKI2_DENOMINATORS)

    def views_for(self, columns: tuple[str, ...]) -> tuple[str, ...]:
        """``sent0,ski`` -> ``sent0, sent0, ski`` (two dropout views and the SKI); NLI rows with a ``ski`` column
        are read as they are."""
        if SKI_VIEW not in columns:
            raise ValueError(f"objective=skicse needs a {SKI_VIEW!r} column, the data has {columns}: train on a "
                             "file written by `fastprompt generate-ski` (sent0,ski) or NLI rows joined with "
                             "fastprompt.data.join_ski (sent0,sent1,hard_neg,ski)")
        if columns == ("sent0", SKI_VIEW):
            return ("sent0", "sent0", SKI_VIEW)
        if columns[:2] != ("sent0", "sent1") or any(c.startswith(HARD_NEGATIVE_VIEW + "_") for c in columns):
            raise ValueError(f"objective=skicse reads sent0,ski or sent0,sent1[,hard_neg],ski rows (one hard negative "
                             f"at most), got {columns}")
        return columns

    def _term(self, z1, z2, z3, offset):
        return contrastive_loss(z1, z2, z3, temperature=self.temperature,
                                hard_negative_weight=self.hard_negative_weight if z3 is not None else 0.0,
                                positive_offset=offset, backend=self.backend, return_stats=True, check_finite=False)

    def loss(self, views: Views) -> ObjectiveOutput:
        names = views.names
        if SKI_VIEW not in names or len(names) not in (3, 4) or names[0] != "sent0":
            raise ValueError(f"skicse needs the views sent0, sent0|sent1[, {HARD_NEGATIVE_VIEW}], {SKI_VIEW}; got "
                             f"{names}")
        if views.gathered.shape[1] < 2:
            raise ValueError("a batch of one row has no in-batch negative: use batch_size >= 2")
        off, local, gathered = views.positive_offset, views.local, views.gathered
        ski = views.index(SKI_VIEW)
        hard = gathered[views.index(HARD_NEGATIVE_VIEW)] if HARD_NEGATIVE_VIEW in names else None
        anchor = local[0]
        main, st = self._term(anchor, gathered[1], hard, off)  # Eq. 1 (unsupervised) or Eq. 4
        # cos(h_i, k_i): each sentence with its own SKI (float32, as the op computes its logits)
        ski_cos = F.cosine_similarity(anchor.float(), local[ski].float(), dim=-1)
        stats = {
            "pos_cos": st.pos_sim.mean().detach(),
            "hard_neg_cos": st.hardest_neg_sim.mean().detach(),
            "acc": (st.pos_sim > st.hardest_neg_sim).float().mean(),
            "loss_cl": main.detach(),
            "ski_cos": ski_cos.detach().mean(),
        }
        if names[1] != "sent1":  # unsupervised: Eq. 3
            l_ski, _ = self._term(anchor, gathered[ski], None, off)  # Eq. 2
            stats["loss_ski"] = l_ski.detach()
            return ObjectiveOutput((1.0 - self.ski_weight) * main + self.ski_weight * l_ski, stats)
        ski1, _ = self._term(local[ski], gathered[1], hard, off)  # Eq. 5
        if self.ski2_denominator == "printed":  # Eq. 6: L_sup's denominator, the SKI in the numerator
            pos_cos = F.cosine_similarity(anchor.float(), local[1].float(), dim=-1)
            ski2 = main + ((pos_cos - ski_cos) / self.temperature).mean()
        else:
            ski2, _ = self._term(anchor, gathered[ski], None, off)
        stats["loss_ski"], stats["loss_ski2"] = ski1.detach(), ski2.detach()
        total = (1.0 - self.ski1_weight - self.ski2_weight) * main + self.ski1_weight * ski1 + self.ski2_weight * ski2
        return ObjectiveOutput(total, stats)

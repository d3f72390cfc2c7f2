"""PromCSE's objective: InfoNCE + 10 x the energy-based hinge loss (Jiang et al., EMNLP 2022 Findings).

L_EH = mean_i [m + cos(h_i, ĥ_i) - cos(h_i, h_i⁺)]₊ with ĥ_i the most similar non-positive column: an
in-batch sentence, or a hard negative when the data has them. It works on pairs and on triplets (the
original code applies it to triplets only). Both terms come from one call of the fused
:func:`fastprompt.ops.contrastive_loss`.
"""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.objectives.config import OBJECTIVE_REGISTRY, check_hinge_weight, objective_default


@dataclass
class PromCSEEH(SimCSE):
    """total = L_CL + hinge_weight · L_EH (PromCSE: margin m = 0.2, weight 10)."""

    hinge_margin: float = objective_default("hinge_margin")
    hinge_weight: float = OBJECTIVE_REGISTRY["promcse_eh"].default_hinge_weight

    name = "promcse_eh"
    description = "InfoNCE + energy-based hinge loss over the hardest negative (PromCSE)"
    citation = """@inproceedings{jiang2022promcse,
  title = {Improved Universal Sentence Embeddings with Prompt-based Contrastive Learning and Energy-based Learning},
  author = {Jiang, Yuxin and Zhang, Linhan and Wang, Wei},
  booktitle = {Findings of the Association for Computational Linguistics: EMNLP 2022},
  year = {2022}
}"""

    def __post_init__(self):
        check_hinge_weight(self.name, self.hinge_weight)

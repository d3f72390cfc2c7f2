"""The toy method's sentence objective: alignment only (no negatives)."""
from dataclasses import dataclass

import torch.nn.functional as F

from fastprompt.objectives import ObjectiveOutput, SentenceObjective, Views
from fastprompt.objectives.config import objective_default


@dataclass
class ToyAlignment(SentenceObjective):
    """Mean over anchors of (1 - cos(anchor, its positive)) / temperature."""

    temperature: float = objective_default("temperature")

    name = "toy"
    stat_names = ("pos_cos",)

    def loss(self, views: Views) -> ObjectiveOutput:
        anchors = views.local[0]
        positives = views.gathered[1, views.positive_offset:views.positive_offset + anchors.shape[0]]
        cos = F.cosine_similarity(anchors.float(), positives.float(), dim=-1)
        return ObjectiveOutput((1 - cos).mean() / self.temperature, {"pos_cos": cos.mean().item()})

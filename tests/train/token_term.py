"""A test-only token-level term that exercises every part of the objective contract.

It reconstructs randomly chosen tokens of each row through the *prompted* encoder (the chosen tokens are
replaced by the mask token), conditioned on the row's sentence embedding ``h`` through a trainable projection:
prompt gradients, gradients into ``h`` (so into the pooler head and the sentence forwards), and parameters of
its own. Not a method of any paper: the real MLM and replaced-token-detection terms build on the same contract.
"""
import torch
import torch.nn.functional as F
from torch import nn

from fastprompt.objectives import TokenTerm, WeightSchedule


class ReconstructionTerm(TokenTerm):
    def __init__(self, hidden_size: int, mask_token_id: int, weight: WeightSchedule = WeightSchedule(0.5),
                 rate: float = 0.3, name: str = "recon", sentence_embedding: str = "after_head"):
        self.sentence_embedding = sentence_embedding  # an instance setting here; a class attribute in real terms
        super().__init__(name, weight)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.mask_token_id, self.rate = mask_token_id, rate

    def make_extras(self, batch, generator):
        real = batch.attention_mask.bool()
        real[:, 0] = False  # never the [CLS]/<s> token
        pick = (torch.rand(batch.input_ids.shape, generator=generator) < self.rate) & real
        return {f"{self.name}_labels": torch.where(pick, batch.input_ids, torch.full_like(batch.input_ids, -100))}

    def num_targets(self, extras):
        return (extras[f"{self.name}_labels"] != -100).sum()

    def forward(self, encoder, inputs, extras, h):
        labels = extras[f"{self.name}_labels"]
        targets = labels != -100
        ids = torch.where(targets, torch.full_like(labels, self.mask_token_id), inputs["input_ids"])
        hidden = encoder.hidden_states(ids, inputs["attention_mask"], inputs.get("token_type_ids"))
        rows = targets.nonzero()[:, 0]
        states = hidden[targets].float() + self.proj(h.float())[rows]
        logits = states @ encoder.backbone.get_input_embeddings().weight.float().T
        return F.cross_entropy(logits, labels[targets], reduction="sum")

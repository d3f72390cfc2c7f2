"""The toy method's token term and its builder: masked tokens of view 0 predicted through the prompted encoder
with the word embeddings as the output layer."""
import torch
import torch.nn.functional as F

from fastprompt.objectives import TokenTerm, WeightSchedule


class ToyTerm(TokenTerm):
    def __init__(self, mask_token_id: int, rate: float, weight: WeightSchedule):
        super().__init__("toy", weight)
        self.mask_token_id, self.rate = mask_token_id, rate

    def make_extras(self, batch, generator):
        pick = (torch.rand(batch.input_ids.shape, generator=generator) < self.rate) & batch.attention_mask.bool()
        pick[:, 0] = False  # never [CLS]
        pick[batch.batch_size:] = False  # view 0 only
        return {"toy_labels": torch.where(pick, batch.input_ids, -100)}

    def num_targets(self, extras):
        return (extras["toy_labels"] != -100).sum()

    def forward(self, encoder, inputs, extras, h):
        labels = extras["toy_labels"]
        targets = labels != -100
        ids = torch.where(targets, self.mask_token_id, inputs["input_ids"])
        hidden = encoder.hidden_states(ids, inputs["attention_mask"], inputs.get("token_type_ids"))
        logits = hidden[targets].float() @ encoder.backbone.get_input_embeddings().weight.float().T
        return F.cross_entropy(logits, labels[targets], reduction="sum")


def toy_terms(cfg, encoder):
    """[ToyTerm] when ``toy_weight > 0``, else []."""
    if not cfg.toy.enabled:
        return []
    return [ToyTerm(encoder.tokenizer.mask_token_id, cfg.toy.rate, WeightSchedule(cfg.toy.weight))]

"""The ``mlm`` section of a training config (standard library only: it validates before torch loads)."""
from __future__ import annotations

from dataclasses import dataclass

from fastprompt.choices import MLM_HEADS
from fastprompt.fields import Section, option


@dataclass
class MLMConfig(Section):
    """DCPCSE's auxiliary masked-language-model term (``do_mlm``): ``weight(step) * MLM loss`` through the
    prompted encoder, with the backbone's MLM head (trained as in DCPCSE's code, or frozen)."""

    enabled: bool = option(False, "add the MLM token term (DCPCSE's do_mlm): 15% of each sentence's tokens "
                           "predicted through the prompted encoder", key="do_mlm", identity=True)
    weight: float = option(0.1, "initial weight of the MLM term (DCPCSE's mlm_weight)", ge=0.0, key="mlm_weight",
                           identity=True)
    decay_rate: float = option(0.95, "the MLM weight is mlm_weight * mlm_decay_rate ** (step / mlm_decay_steps)",
                               gt=0.0, le=1.0, key="mlm_decay_rate", identity=True)
    decay_steps: int = option(100, "steps per decay of the MLM weight", gt=0, key="mlm_decay_steps", identity=True)
    probability: float = option(0.15, "share of each sentence's tokens chosen for the MLM term (80% masked, 10% "
                                "random, 10% kept)", gt=0.0, lt=1.0, key="mlm_probability", identity=True)
    head: str = option("checkpoint", "MLM head: the checkpoint's, or tied_new: a new head tied to the word "
                       "embeddings with a trainable transform (for backbones saved without one; not the paper)",
                       choices=MLM_HEADS, key="mlm_head", identity=True)
    train_head: bool = option(True, "train the checkpoint's MLM head with the prompt at learning_rate, its decoder "
                              "an untied copy of the word embeddings (DCPCSE's code, which produced the paper's "
                              "numbers); false: frozen and tied", key="mlm_train_head", identity=True)

    def validate(self) -> "MLMConfig":
        super().validate()
        if self.enabled and self.head == "tied_new" and not self.train_head:
            raise ValueError("mlm_head: tied_new is a new head: it must train (mlm_train_head: true)")
        return self

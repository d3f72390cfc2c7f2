"""Training objectives: one module per method, each composing fastprompt.ops into a scalar loss.

An objective is a callable ``objective(embeddings) -> ObjectiveOutput`` where ``embeddings`` is
``(n_views, batch, hidden)``; it sees embeddings only (never the model), so the trainer can compute the
loss and its gradient w.r.t. the embeddings separately from the encoder's forward/backward.
"""
from fastprompt.objectives.promcse_eh import PromCSEEH
from fastprompt.objectives.simcse import ObjectiveOutput, SimCSE, split_views

#: name -> class; every class is a dataclass whose fields are also TrainConfig keys.
OBJECTIVES = {"simcse": SimCSE, "promcse_eh": PromCSEEH}


def build_objective(name: str, **params):
    """Instantiate an objective by name; ``params`` may hold extra keys (e.g. a whole config dict)."""
    import dataclasses

    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; available: {sorted(OBJECTIVES)}")
    cls = OBJECTIVES[name]
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in fields})


__all__ = ["OBJECTIVES", "ObjectiveOutput", "PromCSEEH", "SimCSE", "build_objective", "split_views"]

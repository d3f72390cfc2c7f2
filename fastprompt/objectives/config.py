"""ObjectiveConfig: the training configuration's section for the sentence-level objective, and the objectives'
registry.

Standard library only, so ``fastprompt train`` rejects a bad objective setting before torch loads. The
objectives are registered by name (:func:`register_objective`: where the class lives, imported only when one is
built), each by its method's one registration call (:func:`fastprompt.methods.register_method`, in
``fastprompt/methods/<name>/``); the ``objective`` key's choices and the builder
(:func:`fastprompt.objectives.objective_from_config`) read the registry. A token-level term's section is named
by its method's registration (``MLMConfig``: ``fastprompt/methods/mlm/``), with flat keys prefixed by the term's
name (``mlm_weight``, ...); so is an objective's own (SKICSE's ``ski`` section: ``fastprompt/methods/skicse/``).
This section keeps the settings the objectives share.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from fastprompt import _moved
from fastprompt.choices import HARDNESS_MODES, LOSS_BACKENDS, MARGIN_STRATEGIES
from fastprompt.fields import Section, option

#: The smallest temperature: below it float32 rounding of the cosine/temperature logits swamps the loss.
MIN_TEMPERATURE = 1e-3
#: The largest term a config key adds to a logit (hard_negative_weight, hardness_strength x cosine): the logits
#: themselves are at most 1 / MIN_TEMPERATURE; beyond that the added term alone decides the softmax.
MAX_LOGIT_TERM = 1 / MIN_TEMPERATURE


@dataclass(frozen=True)
class ObjectiveEntry:
    """A registered sentence-level objective: its class (a ``SentenceObjective`` dataclass, or ``"module:Class"``,
    imported when the objective is built), its hinge_weight when the config leaves it null, and its rules on the
    objective section when it is the chosen one (``check(section)``, raising ValueError; standard library only)."""

    target: str | type
    default_hinge_weight: float = 0.0
    check: Callable[["ObjectiveConfig"], None] | None = None


#: name -> entry: the one list of sentence-level objectives, in the order of the ``objective`` key's choices.
OBJECTIVE_REGISTRY: dict[str, ObjectiveEntry] = {}


def register_objective(name: str, target: str | type, *, default_hinge_weight: float = 0.0,
                       check: Callable[["ObjectiveConfig"], None] | None = None) -> None:
    """Make ``objective: name`` build ``target`` (a ``SentenceObjective`` dataclass or its ``"module:Class"``).

    Its constructor arguments are read from :class:`ObjectiveConfig`'s fields of the same names (``backend``
    from ``loss_backend``, ``hinge_weight`` resolved: the config's, else ``default_hinge_weight``); an argument
    the config has no key for keeps the class's default. ``check(section)``: the objective's own rules on the
    section, run when it is chosen. A method registers its objective with its registration
    (:func:`fastprompt.methods.register_method`). See ``docs/objectives.md``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"an objective's name must be an identifier, got {name!r}")
    if name in OBJECTIVE_REGISTRY:
        raise ValueError(f"objective {name!r} is already registered ({OBJECTIVE_REGISTRY[name].target})")
    if isinstance(target, str) and target.count(":") != 1:
        raise ValueError(f"an objective's target is a class or 'module:Class', got {target!r}")
    if check is not None and not callable(check):
        raise TypeError(f"objective {name!r}: check must be callable, got {check!r}")
    OBJECTIVE_REGISTRY[name] = ObjectiveEntry(target, float(default_hinge_weight), check)


def check_hinge_weight(objective: str, hinge_weight: float) -> None:
    """The one rule on hinge_weight: promcse_eh is defined by its hinge term."""
    if objective == "promcse_eh" and hinge_weight <= 0:
        raise ValueError(f"promcse_eh needs hinge_weight > 0 (PromCSE uses 10), got {hinge_weight}; "
                         "use objective=simcse for InfoNCE alone")


@dataclass
class ObjectiveConfig(Section):
    """The sentence-level contrastive objective and the settings of its fused loss."""

    name: str = option("simcse", "sentence-level objective: SimCSE's InfoNCE, PromCSE's InfoNCE + energy-based "
                       "hinge, or SKICSE's InfoNCE + SKI terms (needs a ski column)", choices=OBJECTIVE_REGISTRY,
                       key="objective", identity=True)
    temperature: float = option(0.05, "temperature of the cosine-similarity softmax (below 1e-3 float32 rounding "
                                "of the cos/temperature logits swamps the loss)", ge=MIN_TEMPERATURE,
                                why="below it float32 rounding of the cosine/temperature logits swamps the loss",
                                identity=True)
    hard_negative_weight: float = option(0.0, "added to each anchor's own hard-negative logit (log of SimCSE's "
                                         "weight; 0 = weight 1)", le=MAX_LOGIT_TERM,
                                         why=f"the logits themselves are at most 1/temperature <= {MAX_LOGIT_TERM:g}: "
                                             "a larger weight makes each anchor's hard negative the whole softmax, "
                                             "and the loss measures the weight, not the embeddings (SimCSE: 0, "
                                             "weight 1)", identity=True)
    hinge_margin: float = option(0.2, "margin m of the energy-based hinge max(0, m + cos(h, hardest negative) - "
                                 "cos(h, h+))", ge=0.0, identity=True)
    hinge_weight: float | None = option(None, "weight of the hinge term; null: the objective's default "
                                        "(simcse 0, promcse_eh 10)", ge=0.0, identity=True)
    loss_backend: str = option("auto", "implementation of the fused contrastive_loss op", choices=LOSS_BACKENDS,
                               identity=False)
    hardness_mode: str | None = option(None, "hardness weighting (sentence-transformers' hardness_mode): the "
                                       "negatives whose logits get hardness_strength * stop_grad(cos) added; null: "
                                       "none", choices=HARDNESS_MODES, identity=True)
    hardness_strength: float = option(0.0, "the hardness weighting's strength (sentence-transformers: 9 for "
                                      "in_batch_negatives, 5 for hard_negatives)", ge=0.0, le=MAX_LOGIT_TERM,
                                      why=f"strength x cosine is added to logits of at most 1/temperature <= "
                                          f"{MAX_LOGIT_TERM:g}: a larger strength drowns them, the softmax keeps only "
                                          "the hardest column and the loss measures the weighting, not the "
                                          "embeddings (sentence-transformers: 5 to 9)", identity=True)
    fn_margin: float | None = option(None, "GISTEmbed's false-negative mask, scored by the model's own cosines: a "
                                     "column above the positive's cosine minus this leaves the softmax (absolute: "
                                     "< 2; relative: < 1); null: off", ge=0.0, identity=True)
    fn_margin_strategy: str = option("absolute", "fn_margin below the positive's cosine: absolute (pos - margin) or "
                                     "relative (pos - |pos| * margin)", choices=MARGIN_STRATEGIES,
                                     identity=True)
    matryoshka_dims: list[int] | None = option(None, "Matryoshka: the loss summed over these re-normalised prefixes "
                                               "of the embedding (e.g. [384, 128, 64]), in one fused pass; the "
                                               "final STS table is also scored at each; null: off", ge=1,
                                               identity=True)
    matryoshka_weights: list[float] | None = option(None, "Matryoshka: each dimension's weight (null: 1 each)",
                                                    ge=0.0, identity=True)

    def validate(self) -> "ObjectiveConfig":
        super().validate()
        self._check_loss_options()
        check = OBJECTIVE_REGISTRY[self.name].check
        if check is not None:  # the chosen objective's own rules (its method's registration)
            check(self)
        return self

    def _check_loss_options(self) -> None:
        if (self.hardness_mode is None) != (self.hardness_strength == 0.0):
            raise ValueError(f"hardness_mode and hardness_strength go together (got {self.hardness_mode} and "
                             f"{self.hardness_strength}): set both, or neither")
        self._check_fn_margin()
        dims, weights = self.matryoshka_dims, self.matryoshka_weights
        if weights is not None and weights and not any(w > 0 for w in weights):
            raise ValueError(f"matryoshka_weights {weights} are all 0: the loss would be 0 at every dimension and "
                             "the prompt would not train; give at least one dimension a weight > 0")
        if dims is not None:
            if not dims or len(set(dims)) != len(dims):
                raise ValueError(f"matryoshka_dims must list distinct dimensions, got {dims}")
            if weights is not None and len(weights) != len(dims):
                raise ValueError(f"matryoshka_weights needs one weight per dimension of {dims}, got {weights}")
        elif weights is not None:
            raise ValueError("matryoshka_weights without matryoshka_dims: set the dimensions too")

    def _check_fn_margin(self) -> None:
        """A margin that leaves negatives in the softmax: with every column masked the loss is 0 and nothing trains."""
        margin, strategy = self.fn_margin, self.fn_margin_strategy
        if margin is None:
            return
        if strategy == "absolute" and margin >= 2.0:
            raise ValueError(f"fn_margin={margin:g} (absolute) must be < 2: cosines lie in [-1, 1], so the positive's "
                             "cosine minus the margin would be below every column: every negative would leave the "
                             "softmax, the loss would be 0 and nothing would train (sentence-transformers' "
                             "GISTEmbedLoss: 0 by default)")
        if strategy == "relative" and margin >= 1.0:
            raise ValueError(f"fn_margin={margin:g} with fn_margin_strategy relative must be < 1: the threshold is the "
                             "positive's cosine minus |cosine| x fn_margin, at or below 0 from 1 on, so every column "
                             "more similar than orthogonal (every negative, for most encoders) would leave the softmax "
                             "and nothing would train (a relative margin is a fraction of the positive's cosine: "
                             "sentence-transformers' example, 0.05)")

    @property
    def resolved_hinge_weight(self) -> float:
        """hinge_weight, or the objective's default when it is null."""
        if self.hinge_weight is not None:
            return self.hinge_weight
        return OBJECTIVE_REGISTRY[self.name].default_hinge_weight


def objective_default(field: str):
    """The default of an :class:`ObjectiveConfig` field (``backend``: ``loss_backend``'s), so the objective
    classes (``SimCSE(...)``, ``SKICSE(...)``) built without a config default to the config's values."""
    name = "loss_backend" if field == "backend" else field
    return next(f.default for f in dataclasses.fields(ObjectiveConfig) if f.name == name)


# names that moved away from here keep importing, with a warning (fastprompt._moved)
__getattr__ = _moved.module_getattr(__name__)

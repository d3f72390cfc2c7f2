"""fastprompt's fused contrastive loss as sentence-transformers losses, for people who keep their trainer.

Drop-in replacements, same constructors and same values as sentence-transformers' own::

    from fastprompt.integrations.st_loss import MultipleNegativesRankingLoss        # was: sentence_transformers.losses
    loss = MultipleNegativesRankingLoss(model)                                      # unchanged
    SentenceTransformerTrainer(model=model, train_dataset=ds, loss=loss).train()    # unchanged

- :class:`MultipleNegativesRankingLoss`, :class:`MultipleNegativesSymmetricRankingLoss`: the loss on the
  embeddings of (anchor, positive[, negative_1, ...]) columns, as sentence-transformers computes it: each
  anchor scored by cosine x ``scale`` against every positive and every negative of the batch (the negative
  columns are appended as more candidates), cross-entropy of its own positive; the symmetric variant averages
  it with the positive -> anchors term. Computed by :func:`fastprompt.ops.contrastive_loss`, which never
  materialises the (N, N x columns) score matrix: O(N·d) memory instead of O(N²).
- :class:`CachedMultipleNegativesRankingLoss`, :class:`CachedMultipleNegativesSymmetricRankingLoss`: the same
  with sentence-transformers' own GradCache machinery (``CachedLossMixin``: embed without graph, loss gradient
  w.r.t. the embeddings, re-embed mini-batch by mini-batch with the RNG replayed, from a hook on the returned
  loss's backward). The loss stage needs no chunking: the fused op is O(N·d) for any batch.

Both take every setting of sentence-transformers' ``MultipleNegativesRankingLoss`` that a cosine InfoNCE over
the anchors' candidates is: ``scale``, ``gather_across_devices``, ``hardness_mode`` / ``hardness_strength`` (the
penalty ``strength * stop_grad(cos)`` on the selected negatives' logits, in the op), the symmetric directions
``("query_to_doc", "doc_to_query")`` with ``partition_mode`` "per_direction" or "joint", and ``similarity_fct``
cosine however it is spelt (``util.cos_sim``, ``util.pytorch_cos_sim``, a ``functools.partial`` of either that
binds nothing). They add PromCSE's energy-based hinge on top (``hinge_weight``, ``hinge_margin``: ``relu(margin +
cos(anchor, hardest negative) - cos(anchor, positive))`` averaged over the anchors, the hardest negative taken over
all the anchor's candidates but its positive); 0 (the default) gives sentence-transformers' loss exactly.

Each class subclasses sentence-transformers' class of the same name, so ``isinstance`` checks see
sentence-transformers' loss. The symmetric classes inherit from fastprompt's base variant and from
sentence-transformers' symmetric class, whose constructor only fixes the directions (fastprompt's does the same).
sentence-transformers 6.2 deprecates its symmetric classes (use the base loss with both directions, which
fastprompt's symmetric classes also are): subclassing one raises its DeprecationWarning at class definition, which
is silenced here because it is not about the user's code, and once sentence-transformers removes them fastprompt's
symmetric classes derive from the base variant only.

What the fused op cannot express is refused at construction with a one-line error rather than computed
differently: a similarity other than cosine and the ``query_to_query`` / ``doc_to_doc`` directions (same-type
columns with their own exclusions, which the op's blocks do not have). Use sentence-transformers' own loss for
those.

Precision: the fused op computes in float32 whatever the embeddings' dtype, so under bf16 / fp16 autocast the
loss is a float32 tensor (closer to the float32 loss), where sentence-transformers' returns the autocast dtype;
the gradients reaching the embeddings have their dtype.

sentence-transformers (>= 6) is an optional dependency: this module imports it, ``import fastprompt`` does not.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch

try:
    from sentence_transformers.sentence_transformer import losses as _st_losses
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss as _STCachedMNRL,
    )
    from sentence_transformers.sentence_transformer.losses import (
        MultipleNegativesRankingLoss as _STMNRL,
    )
    from sentence_transformers.util import all_gather_with_grad, cos_sim, get_rank, pytorch_cos_sim
except ImportError as exc:  # pragma: no cover - exercised only without sentence-transformers
    raise ImportError("fastprompt.integrations.st_loss needs sentence-transformers >= 6: "
                      "pip install 'fastprompt[sentence-transformers]'") from exc

from fastprompt.ops import contrastive_loss
from fastprompt.ops.reference import contrastive_loss_reference

__all__ = [
    "MultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
]

def _symmetric_base(name: str) -> tuple[type, ...]:
    """sentence-transformers' (deprecated) symmetric loss ``name`` as an extra base class; none once removed."""
    cls = getattr(_st_losses, name, None)
    return (cls,) if isinstance(cls, type) else ()


_FORWARD = ("query_to_doc",)
_SYMMETRIC = ("query_to_doc", "doc_to_query")
#: sentence-transformers' cosine-similarity functions (pytorch_cos_sim is its older name, calling cos_sim).
_COSINE = (cos_sim, pytorch_cos_sim)


def is_cosine(similarity_fct) -> bool:
    """Whether ``similarity_fct`` is sentence-transformers' cosine similarity: ``cos_sim`` or ``pytorch_cos_sim``,
    possibly wrapped in ``functools.partial`` objects that bind no argument (a partial that binds one, or any other
    callable, is not recognised: the fused op could not tell what it computes)."""
    while isinstance(similarity_fct, functools.partial) and not similarity_fct.args and not similarity_fct.keywords:
        similarity_fct = similarity_fct.func
    return any(similarity_fct is f for f in _COSINE)


def _check_supported(loss) -> None:
    """Raise ValueError for the sentence-transformers settings the fused op does not compute."""
    name = type(loss).__name__
    if not is_cosine(loss.similarity_fct):
        raise ValueError(f"{name}: fastprompt's fused loss scores by cosine similarity only (similarity_fct=cos_sim, "
                         f"got {loss.similarity_fct!r}); use sentence_transformers.losses for other similarities")
    directions = tuple(loss.directions)
    if set(directions) not in (set(_FORWARD), set(_SYMMETRIC)):
        raise ValueError(f"{name}: fastprompt's fused loss supports directions {_FORWARD} or {_SYMMETRIC}, got "
                         f"{directions}; use sentence_transformers.losses for the others")
    if isinstance(loss.hinge_weight, bool) or not isinstance(loss.hinge_weight, (int, float)) \
            or loss.hinge_weight < 0:
        raise ValueError(f"{name}: hinge_weight must be a number >= 0, got {loss.hinge_weight!r}")


def _hinge_config(loss) -> dict[str, Any]:
    """The hinge's keys for the model card, only when the hinge is on (0 is sentence-transformers' loss)."""
    if not loss.hinge_weight:
        return {}
    return {"hinge_weight": loss.hinge_weight, "hinge_margin": loss.hinge_margin}


class MultipleNegativesRankingLoss(_STMNRL):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` computed by fastprompt's fused op.

    Same arguments as sentence-transformers' (``scale`` = 1 / temperature, default 20; ``gather_across_devices``
    all-gathers the candidates of every process with gradient), plus ``hinge_weight`` and ``hinge_margin``
    (PromCSE's energy-based hinge, off by default). See the module docstring for what is not supported.
    """

    def __init__(self, model, scale: float = 20.0, similarity_fct=cos_sim, gather_across_devices: bool = False,
                 directions: tuple[str, ...] = _FORWARD, partition_mode: str = "joint", hardness_mode=None,
                 hardness_strength: float = 0.0, *, hinge_weight: float = 0.0, hinge_margin: float = 0.2) -> None:
        # sentence-transformers' base constructor by name: in the symmetric subclass's MRO the next class is their
        # symmetric loss, whose constructor fixes the directions and does not take them
        _STMNRL.__init__(self, model, scale=scale, similarity_fct=similarity_fct,
                         gather_across_devices=gather_across_devices, directions=directions,
                         partition_mode=partition_mode, hardness_mode=hardness_mode,
                         hardness_strength=hardness_strength)
        self.hinge_weight = hinge_weight
        self.hinge_margin = hinge_margin
        _check_supported(self)

    def compute_loss_from_embeddings(self, embeddings: list[torch.Tensor], labels: torch.Tensor | None = None
                                     ) -> torch.Tensor:
        """The loss of (anchors, positives[, negatives ...]) embeddings; ``labels`` are unused (the positive
        of anchor i is row i of the positive column)."""
        if len(embeddings) < 2:
            raise ValueError(f"Expected at least 2 embeddings, got {len(embeddings)}")
        _check_supported(self)
        anchors, candidates = embeddings[0], list(embeddings[1:])
        n = anchors.shape[0]
        if any(c.shape[0] != n for c in candidates):
            raise ValueError(f"every column needs as many rows as the anchors ({n}), got "
                             f"{[c.shape[0] for c in candidates]}")
        offset = 0
        symmetric = "doc_to_query" in self.directions
        anchors_all = None
        if self.gather_across_devices:
            # this process's anchors against the candidates of every process (gathered with gradient); the reverse
            # term's columns are every process's anchors
            candidates = [all_gather_with_grad(c) for c in candidates]
            anchors_all = all_gather_with_grad(anchors) if symmetric else None
            offset = get_rank() * n
        positives, negatives = candidates[0], candidates[1:]
        if positives.shape[0] < 2 and not negatives:
            # a single candidate: its softmax is 1, so sentence-transformers' loss is exactly 0 (the joint symmetric
            # softmax holds the positive twice: log 2), with a zero gradient; the op refuses it (no negative), and a
            # last batch of one pair must not crash
            constant = math.log(2.0) if symmetric and self.partition_mode == "joint" else 0.0
            return 0.0 * (anchors.sum() + positives.sum()) + constant
        kw = dict(temperature=1.0 / self.scale, hinge_weight=float(self.hinge_weight),
                  hinge_margin=float(self.hinge_margin), symmetric=symmetric,
                  partition_mode=self.partition_mode if symmetric else "per_direction", reverse_columns=anchors_all,
                  hardness_mode=self.hardness_mode, hardness_strength=float(self.hardness_strength),
                  positive_offset=offset)
        z3 = torch.stack(negatives) if negatives else None
        if symmetric and anchors_all is None and n < 2:
            # one anchor: the reverse term has a single column (cross-entropy 0 per direction; joint: the positive
            # twice), which the op refuses as an in-batch loss; its 1 x M scores are the reference's to compute
            return contrastive_loss_reference(anchors, positives, z3, **kw)
        # negative columns are appended as more candidates: columns = cat(positives, negatives_1, ...), which is
        # the op's z2, z3 (k, M2, d) layout
        return contrastive_loss(anchors, positives, z3, **kw)

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), **_hinge_config(self)}


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # subclassing their deprecated class warns at definition

    class MultipleNegativesSymmetricRankingLoss(MultipleNegativesRankingLoss,
                                                *_symmetric_base("MultipleNegativesSymmetricRankingLoss")):
        """sentence-transformers' ``MultipleNegativesSymmetricRankingLoss`` (anchor -> candidates and positive ->
        anchors, each with its own softmax, averaged) computed by fastprompt's fused op."""

        def __init__(self, model, scale: float = 20.0, similarity_fct=cos_sim, gather_across_devices: bool = False,
                     *, hinge_weight: float = 0.0, hinge_margin: float = 0.2) -> None:
            super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                             gather_across_devices=gather_across_devices, directions=_SYMMETRIC,
                             partition_mode="per_direction", hinge_weight=hinge_weight, hinge_margin=hinge_margin)


class CachedMultipleNegativesRankingLoss(_STCachedMNRL):
    """sentence-transformers' ``CachedMultipleNegativesRankingLoss`` (GradCache) with the loss stage computed by
    fastprompt's fused op.

    Same arguments as sentence-transformers' (``mini_batch_size`` / ``mini_batch_num_tokens`` bound the
    embedding passes), plus ``hinge_weight`` and ``hinge_margin``. The three GradCache steps are
    sentence-transformers' own (``CachedLossMixin``), so it works inside ``SentenceTransformerTrainer``
    (gradient accumulation, fp16 scaling, DDP) exactly as theirs; only the loss over the cached embeddings
    differs: one fused call over the whole batch instead of a loop over score-matrix chunks.
    """

    _delegated_to_wrapped_loss = _STCachedMNRL._delegated_to_wrapped_loss + ("hinge_weight", "hinge_margin")

    def __init__(self, model, scale: float = 20.0, similarity_fct=cos_sim, mini_batch_size: int = 32,
                 mini_batch_num_tokens: int | None = None, gather_across_devices: bool = False,
                 directions: tuple[str, ...] = _FORWARD, partition_mode: str = "joint",
                 show_progress_bar: bool = False, hardness_mode=None, hardness_strength: float = 0.0, *,
                 hinge_weight: float = 0.0, hinge_margin: float = 0.2) -> None:
        _STCachedMNRL.__init__(  # by name, as in MultipleNegativesRankingLoss
            self, model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size,
            mini_batch_num_tokens=mini_batch_num_tokens, gather_across_devices=gather_across_devices,
            directions=directions, partition_mode=partition_mode, show_progress_bar=show_progress_bar,
            hardness_mode=hardness_mode, hardness_strength=hardness_strength)
        # the wrapped loss holds (and validates) every hyper-parameter: swap in the fused one
        self.loss = MultipleNegativesRankingLoss(
            model, scale=scale, similarity_fct=similarity_fct, gather_across_devices=gather_across_devices,
            directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
            hardness_strength=hardness_strength, hinge_weight=hinge_weight, hinge_margin=hinge_margin)

    @property
    def hinge_weight(self) -> float:
        return self.loss.hinge_weight

    @property
    def hinge_margin(self) -> float:
        return self.loss.hinge_margin

    def calculate_loss(self, reps: list[list[torch.Tensor]], labels: torch.Tensor | None = None, *,
                       with_backward: bool = False) -> torch.Tensor:
        """The loss over the whole batch from the per-mini-batch embeddings (step 2 of GradCache). With
        ``with_backward`` its gradient reaches the cached embeddings and the detached loss is returned."""
        loss = self.loss.compute_loss_from_embeddings([torch.cat(column) for column in reps], labels)
        if with_backward:
            loss.backward()
            loss = loss.detach()
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), **_hinge_config(self.loss)}


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)

    class CachedMultipleNegativesSymmetricRankingLoss(CachedMultipleNegativesRankingLoss,
                                                      *_symmetric_base("CachedMultipleNegativesSymmetricRankingLoss")):
        """sentence-transformers' ``CachedMultipleNegativesSymmetricRankingLoss`` with the fused loss stage."""

        def __init__(self, model, scale: float = 20.0, similarity_fct=cos_sim, mini_batch_size: int = 32,
                     mini_batch_num_tokens: int | None = None, gather_across_devices: bool = False,
                     show_progress_bar: bool = False, *, hinge_weight: float = 0.0, hinge_margin: float = 0.2) -> None:
            super().__init__(model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size,
                             mini_batch_num_tokens=mini_batch_num_tokens, gather_across_devices=gather_across_devices,
                             directions=_SYMMETRIC, partition_mode="per_direction",
                             show_progress_bar=show_progress_bar, hinge_weight=hinge_weight, hinge_margin=hinge_margin)

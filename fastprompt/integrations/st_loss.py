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

Both accept PromCSE's energy-based hinge on top (``hinge_weight``, ``hinge_margin``: ``relu(margin +
cos(anchor, hardest negative) - cos(anchor, positive))`` averaged over the anchors, the hardest negative taken
over all the anchor's candidates but its positive); 0 (the default) gives sentence-transformers' loss exactly.

Each class subclasses sentence-transformers' class of the same name, so ``isinstance`` checks see
sentence-transformers' loss. The symmetric classes inherit from fastprompt's base variant and from
sentence-transformers' symmetric class, whose constructor only fixes the directions (fastprompt's does the same).
sentence-transformers 6.2 deprecates its symmetric classes (use the base loss with both directions, which
fastprompt's symmetric classes also are): subclassing one raises its DeprecationWarning at class definition, which
is silenced here because it is not about the user's code, and once sentence-transformers removes them fastprompt's
symmetric classes derive from the base variant only.

What the fused op cannot express is refused at construction with a one-line error rather than computed
differently: a similarity other than cosine, the ``query_to_query`` / ``doc_to_doc`` directions, a joint
softmax over two directions, and hardness weighting. Use sentence-transformers' own loss for those.

sentence-transformers (>= 6) is an optional dependency: this module imports it, ``import fastprompt`` does not.
"""
from __future__ import annotations

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
    from sentence_transformers.util import all_gather_with_grad, cos_sim, get_rank
except ImportError as exc:  # pragma: no cover - exercised only without sentence-transformers
    raise ImportError("fastprompt.integrations.st_loss needs sentence-transformers >= 6: "
                      "pip install 'fastprompt[sentence-transformers]'") from exc

from fastprompt.ops import contrastive_loss

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


def _check_supported(loss) -> None:
    """Raise ValueError for the sentence-transformers settings the fused op does not compute."""
    name = type(loss).__name__
    if loss.similarity_fct is not cos_sim:
        raise ValueError(f"{name}: fastprompt's fused loss scores by cosine similarity only (similarity_fct=cos_sim); "
                         "use sentence_transformers.losses for other similarities")
    directions = tuple(loss.directions)
    if set(directions) not in (set(_FORWARD), set(_SYMMETRIC)):
        raise ValueError(f"{name}: fastprompt's fused loss supports directions {_FORWARD} or {_SYMMETRIC}, got "
                         f"{directions}; use sentence_transformers.losses for the others")
    if set(directions) == set(_SYMMETRIC) and loss.partition_mode != "per_direction":
        raise ValueError(f"{name}: the symmetric directions {_SYMMETRIC} need partition_mode='per_direction' "
                         "(a joint softmax over both directions is not supported)")
    if loss.hardness_mode is not None and loss.hardness_strength > 0.0:
        raise ValueError(f"{name}: hardness weighting (hardness_mode={loss.hardness_mode!r}) is not supported by "
                         "fastprompt's fused loss; use sentence_transformers.losses")
    if isinstance(loss.hinge_weight, bool) or not isinstance(loss.hinge_weight, (int, float)) \
            or loss.hinge_weight < 0:
        raise ValueError(f"{name}: hinge_weight must be a number >= 0, got {loss.hinge_weight!r}")


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
        if self.gather_across_devices:
            # this process's anchors against the candidates of every process (gathered with gradient)
            candidates = [all_gather_with_grad(c) for c in candidates]
            offset = get_rank() * n
        # negative columns are appended as more candidates: columns = cat(positives, negatives_1, ...)
        columns = torch.cat(candidates) if len(candidates) > 1 else candidates[0]
        temperature, hinge_weight = 1.0 / self.scale, float(self.hinge_weight)

        def infonce(queries, keys, hinge_weight=0.0, symmetric=False):
            if keys.shape[0] < 2 or (symmetric and queries.shape[0] < 2):
                # a single candidate: its softmax is 1, so sentence-transformers' loss is exactly 0 (zero
                # gradient); the op refuses it (no negative), and a last batch of one pair must not crash
                return 0.0 * (queries.sum() + keys.sum())
            return contrastive_loss(queries, keys, temperature=temperature, hinge_weight=hinge_weight,
                                    hinge_margin=float(self.hinge_margin), symmetric=symmetric,
                                    positive_offset=offset)

        if "doc_to_query" not in self.directions:
            return infonce(anchors, columns, hinge_weight)
        if not self.gather_across_devices and n >= 2:
            # the op's symmetric term: positive i against the anchors, label i (per-direction softmax, averaged)
            return infonce(anchors, columns, hinge_weight, symmetric=True)
        # gathered, the reverse term's columns are the anchors of every process, which the op's symmetric term
        # (local anchors only) does not cover, so it is a second call (also for a single local anchor, which
        # the op's symmetric term refuses). The hinge weight is doubled inside the halved forward term so that
        # it counts once, as with symmetric=True.
        anchors_all = all_gather_with_grad(anchors) if self.gather_across_devices else anchors
        positives = candidates[0][offset:offset + n]
        return 0.5 * (infonce(anchors, columns, 2.0 * hinge_weight) + infonce(positives, anchors_all))

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "hinge_weight": self.hinge_weight, "hinge_margin": self.hinge_margin}


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
        return {**super().get_config_dict(), "hinge_weight": self.hinge_weight, "hinge_margin": self.hinge_margin}


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

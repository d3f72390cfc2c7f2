"""The objective contract: what a training method is made of, and what the trainer promises each part.

A **method** (:class:`Method`) is one sentence-level objective plus any number of token-level terms::

    total loss = sentence(views) + sum_t  weight_t(step) * term_t

**Views by name.** A :class:`~fastprompt.data.Batch` holds ``n_views`` views of ``B`` rows, view-major, and
``view_names``: the data column each view reads (``("sent0", "sent0")`` for unsupervised SimCSE, ``("sent0",
"sent1", "hard_neg")`` for NLI triplets). :meth:`SentenceObjective.views_for` tells the collator which views a
method needs for the data's columns; the collator may tokenise each view with its own function (a template
per view). ``Batch.extras`` holds per-row, token-aligned tensors of the token terms, shaped ``(rows, seq_len,
...)`` like ``input_ids`` (view-major, right-padded); a step slices and trims them together with the token ids.
Label tensors use -100 for the rows and tokens a term ignores (the Hugging Face convention).

**The sentence-level objective** (:class:`SentenceObjective`) sees pooled embeddings only, after the pooler
head, as :class:`Views`: ``local`` (n_views, B_local, H), this process's rows; ``gathered`` (n_views, B_global,
H), every process's rows, with this process's at ``positive_offset``; and ``names``. It returns an
:class:`ObjectiveOutput` whose loss is the mean over its **local** anchors, contrasted against the gathered
columns (build the call(s) to :func:`fastprompt.ops.contrastive_loss` from the views). The trainer turns that
mean into this process's share of the global-batch mean. It runs on the loss side of a step, with no model.

**A token-level term** (:class:`TokenTerm`, an ``nn.Module``; its parameters are trained, all-reduced and
saved in ``last/`` with the optimizer) runs its own forward passes through the prompted encoder on the batch's
extras, locally, one micro-batch at a time:

- ``make_extras(batch, generator)`` builds its extras for a collated (CPU) batch; ``generator`` is seeded
  from the step's seed and the term's name, so extras are reproducible (and resume exactly).
- ``num_targets(extras)`` counts its target tokens in some rows. The trainer sums it over the whole global
  batch (all micro-batches, all processes) into ``N``.
- ``forward(encoder, inputs, extras, h)`` returns the **sum** of its per-target losses over the rows of
  ``inputs`` (a micro-batch: token ids with their padding trimmed, the same rows' extras trimmed alike, and
  ``h``: their sentence embeddings (rows, H), as ``sentence_embedding`` asks: ``"after_head"`` (what the
  sentence objective sees), ``"before_head"`` (the pooled vector; DiffCSE's ``--before_mlp``), or None (not
  read: ``h`` is None). The gradient flows into ``h``; the trainer routes it back through the head (when
  after it) and the encoder.
- the trainer divides by ``N`` (so the term is a mean over the global batch's targets, whatever the
  micro-batch or process split), multiplies by ``weight(step)`` (a :class:`WeightSchedule`), and logs
  ``loss_<name>`` (the unweighted global mean) and ``w_<name>`` in ``train_log.csv``.
- its forwards run under :func:`torch.random.fork_rng`, seeded from (step seed, term name, micro-batch
  index): they never shift the sentence forwards' dropout stream, and a reference can replay them.

How a step computes all this with and without the gradient cache, and over several processes, is in
:mod:`fastprompt.train.steps`; the full contract, and how to write a term: ``docs/objectives.md``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fastprompt.data.collate import Batch

#: Views a sentence objective reads by name (they are the data's column names): the contradiction of an NLI
#: triplet, used as a hard negative, and the SKI of a sentence (SKICSE).
HARD_NEGATIVE_VIEW = "hard_neg"
SKI_VIEW = "ski"


@dataclass
class ObjectiveOutput:
    """The scalar loss and detached statistics for logging: 0-d tensors left on the device (a training step never
    waits for the GPU; the trainer reads them at its log rows) or floats."""

    loss: torch.Tensor
    stats: dict[str, torch.Tensor | float]


@dataclass
class Views:
    """Post-head sentence embeddings of a batch's views, as the sentence-level objective sees them.

    local: (n_views, B_local, H), this process's rows. gathered: (n_views, B_global, H), every process's
    rows in process order (``local is gathered`` in a single process). positive_offset: where this process's
    rows start in ``gathered``'s batch dimension. names: the view names of the batch. ids: (n_views, B_global)
    int64 text ids of the gathered rows (``Batch.text_ids``; -1: a padding negative), or None when the batch has
    none; the objective passes them to the fused loss's false-negative mask.
    """

    names: tuple[str, ...]
    local: torch.Tensor
    gathered: torch.Tensor
    positive_offset: int = 0
    ids: torch.Tensor | None = None

    def __post_init__(self):
        if self.local.dim() != 3 or self.gathered.dim() != 3:
            raise ValueError(f"views must be (n_views, batch, hidden), got local {tuple(self.local.shape)} and "
                             f"gathered {tuple(self.gathered.shape)}")
        if len(self.names) != self.local.shape[0] or self.gathered.shape[0] != self.local.shape[0]:
            raise ValueError(f"{len(self.names)} view names {self.names} for local {tuple(self.local.shape)} and "
                             f"gathered {tuple(self.gathered.shape)} embeddings")
        if self.ids is not None and tuple(self.ids.shape) != tuple(self.gathered.shape[:2]):
            raise ValueError(f"text ids of shape {tuple(self.ids.shape)} for gathered embeddings "
                             f"{tuple(self.gathered.shape)}: one id per gathered row")

    @classmethod
    def single(cls, embeddings: torch.Tensor, names: Sequence[str] | None = None) -> "Views":
        """The views of one process: ``embeddings`` (n_views, B, H), named by position when ``names`` is None."""
        if embeddings.dim() != 3:
            raise ValueError(f"embeddings must be (n_views, batch, hidden), got shape {tuple(embeddings.shape)}")
        names = tuple(names) if names is not None else Batch.default_view_names(embeddings.shape[0])
        return cls(names, embeddings, embeddings, 0)

    def index(self, name: str) -> int:
        """Position of the first view called ``name``."""
        if name not in self.names:
            raise KeyError(f"no view named {name!r}; the batch has {self.names}")
        return self.names.index(name)


class SentenceObjective:
    """Base of the sentence-level objectives: a loss over :class:`Views` (see the module docstring)."""

    name: str = ""
    #: The statistics an output's ``stats`` holds (train_log.csv columns).
    stat_names: tuple[str, ...] = ()
    #: One line saying what the objective is, for an exported model's card (its "method" row); "": the card shows
    #: the objective's name. Like sentence-transformers' losses (their ``citation``), the text lives on the class,
    #: so an objective registered anywhere brings its own.
    description: str = ""
    #: BibTeX of the paper the objective comes from, for the model card's "Citation" section ("": none).
    citation: str = ""

    def views_for(self, columns: tuple[str, ...]) -> tuple[str, ...]:
        """The views a batch needs for rows with these data columns: the columns, one column twice (its two
        dropout views)."""
        return columns * 2 if len(columns) == 1 else columns

    def __call__(self, views: Views | torch.Tensor) -> ObjectiveOutput:
        """Loss of :class:`Views`, or of one process's (n_views, B, H) embeddings named by position."""
        return self.loss(views if isinstance(views, Views) else Views.single(views))

    def loss(self, views: Views) -> ObjectiveOutput:
        raise NotImplementedError


@dataclass(frozen=True)
class WeightSchedule:
    """The weight of a token term at an optimisation step: ``initial * decay_rate ** (step / decay_steps)``.

    ``step`` counts optimisation steps from 0 (the step being computed). ``decay_rate=1`` is a constant weight;
    DCPCSE's MLM weight is ``WeightSchedule(0.1, 0.95, 100)``.
    """

    initial: float
    decay_rate: float = 1.0
    decay_steps: int = 1

    def __post_init__(self):
        if self.initial < 0:
            raise ValueError(f"a term weight must be >= 0, got {self.initial}")
        if not 0 < self.decay_rate <= 1:
            raise ValueError(f"decay_rate must be in (0, 1], got {self.decay_rate}")
        if self.decay_steps < 1:
            raise ValueError(f"decay_steps must be >= 1, got {self.decay_steps}")

    def __call__(self, step: int) -> float:
        return self.initial * self.decay_rate ** (step / self.decay_steps)


#: The sentence embeddings a token term may read (``TokenTerm.sentence_embedding``).
AFTER_HEAD, BEFORE_HEAD = "after_head", "before_head"


class TokenTerm(nn.Module):
    """Base of the token-level terms (see the module docstring for what the trainer does with each method).

    Subclasses set ``name`` (an identifier: log columns ``loss_<name>``/``w_<name>``, RNG streams; prefix
    their extras' keys with it) and ``weight``, and implement :meth:`num_targets` and :meth:`forward`.
    """

    #: Which sentence embeddings ``h`` :meth:`forward` reads: None, AFTER_HEAD or BEFORE_HEAD (D2CSE's
    #: conditional replaced-token detection reads one of them).
    sentence_embedding: str | None = None

    def __init__(self, name: str, weight: WeightSchedule):
        super().__init__()
        if not name.isidentifier():
            raise ValueError(f"a term name must be an identifier (it names log columns), got {name!r}")
        if self.sentence_embedding not in (None, AFTER_HEAD, BEFORE_HEAD):
            raise ValueError(f"sentence_embedding must be None, {AFTER_HEAD!r} or {BEFORE_HEAD!r}, "
                             f"got {self.sentence_embedding!r}")
        self.name, self.weight = name, weight

    def make_extras(self, batch: Batch, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """This term's extras for a collated batch (on the CPU), each (batch.rows, seq_len, ...)."""
        return {}

    def num_targets(self, extras: dict[str, torch.Tensor]) -> torch.Tensor:
        """Number of target tokens in these rows' extras (an integer tensor)."""
        raise NotImplementedError

    def forward(self, encoder, inputs: dict[str, torch.Tensor], extras: dict[str, torch.Tensor],
                h: torch.Tensor | None) -> torch.Tensor:
        """Sum of the per-target losses over these rows (a scalar), through ``encoder``'s prompted model."""
        raise NotImplementedError


class Method(nn.Module):
    """What training optimises: one :class:`SentenceObjective` and any number of :class:`TokenTerm`."""

    def __init__(self, sentence: SentenceObjective, terms: Sequence[TokenTerm] = ()):
        super().__init__()
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"token terms need distinct names, got {names}")
        self.sentence = sentence
        self.terms = nn.ModuleList(terms)

    def log_columns(self) -> tuple[str, ...]:
        """The statistics of a step, as train_log.csv columns."""
        cols = tuple(self.sentence.stat_names)
        if len(self.terms):
            cols += ("loss_sentence",)
        for t in self.terms:
            cols += (f"loss_{t.name}", f"w_{t.name}")
        return cols

    def resume_state(self) -> dict[str, torch.Tensor]:
        """What ``last/`` saves of the terms: trainable parameters and buffers (BatchNorm statistics, ...).

        Frozen parameters (a language-model head loaded from the backbone's checkpoint, possibly tied to its
        word embeddings) are rebuilt from their source at setup, so they are neither saved nor loaded.
        """
        frozen = {name for name, p in self.named_parameters() if not p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k not in frozen}

    def add_extras(self, batch: Batch, generators: dict[str, torch.Generator]) -> Batch:
        """``batch`` with every term's extras (``generators``: one per term name)."""
        for t in self.terms:
            extras = t.make_extras(batch, generators[t.name])
            clash = set(extras) & set(batch.extras)
            if clash:
                raise ValueError(f"term {t.name!r} makes extras {sorted(clash)} that another term already made")
            batch.extras.update(extras)
        batch.check_extras()
        return batch

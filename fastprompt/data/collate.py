"""Tokenisation and collation: rows of sentences -> one padded tensor batch holding every view.

All views of a batch are encoded in one forward pass, laid out view-major: rows ``[v*B, (v+1)*B)`` are
view ``v`` of the ``B`` examples, so the encoder's ``(n_views*B, H)`` output reshapes to
``(n_views, B, H)``. Views have names (``Batch.view_names``): the data column each view reads, e.g.
``("sent0", "sent0")`` for unsupervised SimCSE (one sentence, two dropout views) and
``("sent0", "sent1", "hard_neg")`` for NLI triplets. Padding is dynamic: to the longest sequence of the
batch, truncated at ``max_length`` tokens (32 by default, as in SimCSE/DCPCSE/PromCSE).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fastprompt.data.retrieval import PAD_TEXT
from fastprompt.host_sync import host_side

#: Column names of rows with 1, 2 and 3 sentences when the data does not name them.
DEFAULT_COLUMNS = {1: ("sent0",), 2: ("sent0", "sent1"), 3: ("sent0", "sent1", "hard_neg")}


@dataclass
class Batch:
    """Token ids of ``n_views`` views of ``batch_size`` examples, view-major.

    ``extras``: per-row tensors of token-level objective terms (masked-token ids, labels, ...), first
    dimension ``n_views * batch_size`` in the same view-major order, sliced along with the token ids when a
    step splits the batch into micro-batches. Label tensors use -100 for rows/tokens a term ignores.

    ``template_index``: (rows,) which of the run's templates each row was wrapped in, when views use different
    templates (PromptBERT); it travels with the model inputs, so a micro-batch knows its rows' templates.

    ``text_ids``: (rows,) int64, view-major, when the collator was asked for them: a 63-bit hash of each row's text
    (:func:`text_id`; equal texts, equal ids, on every process) or -1 for a padding negative. The loss side reads
    them (the fused loss's false-negative mask); they are not model inputs.

    ``lengths``: each row's number of real tokens, as host integers: counted from the attention mask while it is
    still a CPU tensor (at collation) and kept by :meth:`to`, so a packed forward, the gradient cache's micro-batch
    plan and the token count never read the mask back from the GPU.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor | None
    n_views: int
    batch_size: int
    view_names: tuple[str, ...] = ()
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    template_index: torch.Tensor | None = None
    text_ids: torch.Tensor | None = None
    lengths: tuple[int, ...] | None = None

    def __post_init__(self):
        self.view_names = tuple(self.view_names) or self.default_view_names(self.n_views)
        if len(self.view_names) != self.n_views:
            raise ValueError(f"{self.n_views} views need {self.n_views} names, got {self.view_names}")
        self.check_extras()
        if self.lengths is None and self.attention_mask.device.type == "cpu":
            with host_side():  # a collator's fresh CPU tensor, on the host in every run
                self.lengths = tuple(self.attention_mask.sum(1).tolist())  # host read: a CPU tensor
        elif self.lengths is not None:
            self.lengths = tuple(int(n) for n in self.lengths)
            if len(self.lengths) != self.attention_mask.shape[0]:
                raise ValueError(f"lengths has {len(self.lengths)} entries for {self.attention_mask.shape[0]} rows")

    @staticmethod
    def default_view_names(n_views: int) -> tuple[str, ...]:
        """Names of views given by position: anchor, positive, hard negative (SimCSE's layout)."""
        return DEFAULT_COLUMNS.get(n_views, tuple(f"view{i}" for i in range(n_views)))

    def check_extras(self) -> None:
        """Every extra is token-aligned with ``input_ids``: (rows, seq_len, ...)."""
        for name, value in self.extras.items():
            if value.dim() < 2 or tuple(value.shape[:2]) != tuple(self.input_ids.shape):
                raise ValueError(f"extra {name!r} has shape {tuple(value.shape)}; extras are token-aligned with "
                                 f"input_ids {tuple(self.input_ids.shape)}: (rows, seq_len, ...)")

    @property
    def rows(self) -> int:
        """Sequences in the batch: ``n_views * batch_size``."""
        return self.n_views * self.batch_size

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on ``device`` (host lengths kept). The copies do not block the host (``non_blocking``: a
        blocking copy to a GPU waits for every kernel queued before it); the CPU tensors are not written again."""

        def move(x):
            return None if x is None else x.to(device, non_blocking=True)

        return Batch(move(self.input_ids), move(self.attention_mask), move(self.token_type_ids), self.n_views,
                     self.batch_size, self.view_names, {k: move(v) for k, v in self.extras.items()},
                     move(self.template_index), move(self.text_ids), self.lengths)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        out = {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        if self.token_type_ids is not None:
            out["token_type_ids"] = self.token_type_ids
        if self.template_index is not None:
            out["template_index"] = self.template_index
        return out

    @property
    def num_tokens(self) -> int:
        """Real tokens in the batch (from the host lengths; read from the mask only for a batch built without)."""
        # host read: only for a batch built without host lengths
        return sum(self.lengths) if self.lengths is not None else int(self.attention_mask.sum())


def text_id(text: str) -> int:
    """A text's id for the false-negative mask: the first 63 bits of its BLAKE2b hash (the same on every process
    and in every run; two distinct texts share one with probability 2^-63), -1 for a padding negative."""
    if text == PAD_TEXT:
        return -1
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def hf_tokenize(tokenizer) -> Callable[[list[str], int], dict]:
    """A tokenize function over a Hugging Face tokenizer: dynamic padding, truncation at ``max_length``."""

    def tokenize(texts: list[str], max_length: int) -> dict:
        return dict(tokenizer(texts, padding="longest", truncation=True, max_length=max_length, return_tensors="pt"))

    return tokenize


class Collator:
    """Turns a list of rows (tuples of sentences) into a :class:`Batch`.

    ``tokenize(texts, max_length) -> {"input_ids", "attention_mask"[, "token_type_ids"]}`` pads to the longest
    text; pass ``PromptEncoder.tokenize`` (which also wraps sentences in a template when the encoder has one)
    or :func:`hf_tokenize` of a Hugging Face tokenizer.

    columns: the names of a row's sentences (default: ``sent0``, ``sent1``, ``hard_neg`` by row width).
    views: the column each view reads, in view order (default: the columns; a single column twice, which is
        unsupervised SimCSE: the two views differ only by the encoder's dropout noise). A column read by
        several views with the same tokenize function is tokenised once.
    view_tokenize: per view, a tokenize function replacing ``tokenize`` (None keeps it), e.g. a different
        prompt template per view; views tokenised apart are right-padded to a common width with
        ``pad_token_id``.
    text_ids: also give the batch its rows' text ids (``Batch.text_ids``). A padding negative
        (:data:`~fastprompt.data.retrieval.PAD_TEXT`) is tokenised as an empty text.
    pad_widths: ascending widths a batch is right-padded to: the smallest that holds its longest row (a batch
        wider than all of them keeps its width). None: the longest row's width. A few fixed widths let a CUDA graph
        per width replay every batch (``cuda_graphs``); the padding is masked, so the maths stays the same.
    """

    def __init__(self, tokenize: Callable[[list[str], int], dict], max_length: int = 32, *,
                 columns: Sequence[str] | None = None, views: Sequence[str] | None = None,
                 view_tokenize: Sequence[Callable | None] | None = None, pad_token_id: int = 0,
                 text_ids: bool = False, pad_widths: Sequence[int] | None = None):
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for the special tokens), got {max_length}")
        if not callable(tokenize):
            raise TypeError("tokenize must be a callable (texts, max_length) -> dict of tensors")
        self.tokenize = tokenize
        self.max_length = int(max_length)
        self.columns = tuple(columns) if columns is not None else None
        self.views = tuple(views) if views is not None else None
        if self.views is not None and self.columns is not None and not set(self.views) <= set(self.columns):
            raise ValueError(f"views {self.views} read columns the rows do not have ({self.columns})")
        self.view_tokenize = tuple(view_tokenize) if view_tokenize is not None else None
        if self.view_tokenize is not None and (self.views is None or len(self.view_tokenize) != len(self.views)):
            raise ValueError("view_tokenize needs views= and one entry (a function or None) per view")
        self.pad_token_id = pad_token_id
        self.text_ids = text_ids
        self.pad_widths = pad_widths

    @property
    def pad_widths(self) -> tuple[int, ...] | None:
        return self._pad_widths

    @pad_widths.setter
    def pad_widths(self, widths: Sequence[int] | None) -> None:
        if widths is not None:
            widths = tuple(widths)
            if not widths or any(not isinstance(w, int) or w < 1 for w in widths) or list(widths) != sorted(
                    set(widths)):
                raise ValueError(f"pad_widths must be ascending positive ints, got {widths}")
        self._pad_widths = widths

    def __call__(self, rows: Sequence[tuple[str, ...]]) -> Batch:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        width = len(rows[0])
        if any(len(r) != width for r in rows):
            raise ValueError("all rows of a batch must have the same number of sentences")
        columns = self.columns or DEFAULT_COLUMNS.get(width) or tuple(f"col{i}" for i in range(width))
        if len(columns) != width:
            raise ValueError(f"rows have {width} sentences but the columns are {columns}")
        views = self.views or (columns * 2 if width == 1 else columns)
        fns = self.view_tokenize or (None,) * len(views)
        # Tokenise each distinct (column, function) once; views with the default function share one call
        # (padded together), as do repeated views of one column.
        groups: dict[Callable, list[str]] = {}
        for col, fn in zip(views, fns):
            cols = groups.setdefault(fn or self.tokenize, [])
            if col not in cols:
                cols.append(col)
        encoded: dict[tuple[str, Callable], dict[str, torch.Tensor]] = {}
        for fn, cols in groups.items():
            texts = [row[columns.index(c)] for c in cols for row in rows]
            enc = fn([t if t != PAD_TEXT else "" for t in texts], self.max_length)
            for i, c in enumerate(cols):
                encoded[c, fn] = {k: v[i * len(rows):(i + 1) * len(rows)] for k, v in enc.items()
                                  if k in ("input_ids", "attention_mask", "token_type_ids")}
        parts = [encoded[col, fn or self.tokenize] for col, fn in zip(views, fns)]
        width_tokens = max(p["input_ids"].shape[1] for p in parts)
        if self.pad_widths is not None:
            width_tokens = next((w for w in self.pad_widths if w >= width_tokens), width_tokens)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if all(k in p for p in parts)]
        out = {k: torch.cat([_pad_right(p[k], width_tokens, self.pad_token_id if k == "input_ids" else 0)
                             for p in parts]) for k in keys}
        ids = None
        if self.text_ids:
            ids = torch.tensor([text_id(row[columns.index(col)]) for col in views for row in rows], dtype=torch.long)
        return Batch(out["input_ids"], out["attention_mask"], out.get("token_type_ids"), n_views=len(views),
                     batch_size=len(rows), view_names=views, text_ids=ids)


def _pad_right(x: torch.Tensor, width: int, value: int) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

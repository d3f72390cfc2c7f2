"""The prompted encoder's text faces: :meth:`EncodingMixin.tokenize` (sentences -> padded token ids, with a
template or an appended EOS) and the inference API, :meth:`EncodingMixin.encode` (sentences -> vectors, batched by
token count) and :meth:`EncodingMixin.similarity`. A mixin of :class:`~fastprompt.model.encoder.PromptEncoder`,
which holds the tokenizer, the template settings and the forward they call."""
from __future__ import annotations

import logging
import sys

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from fastprompt.host_sync import host_side
from fastprompt.messages import shown

from .template import Template, end_with_eos, wrap_batch

logger = logging.getLogger(__name__)


class EncodingMixin:
    """Tokenisation and encoding of :class:`~fastprompt.model.encoder.PromptEncoder` (see the module docstring)."""

    def model_max_tokens(self) -> int:
        """Longest sequence (special tokens included) the backbone's positions and tokenizer allow."""
        return min(self.tokenizer.model_max_length, 512, self.max_input_length or 512)

    def tokenize(self, sentences: list[str], max_length: int | None = None,
                 template: str | Template | None = None) -> dict[str, torch.Tensor]:
        """Token ids padded to the longest sequence of the batch (dynamic padding), on the tokenizer's
        ``padding_side``.

        Without a template, ``max_length`` bounds the whole sequence (special tokens included), as a Hugging Face
        tokenizer does. With one (the encoder's, or ``template``), it bounds the sentence's own tokens and the
        template comes on top, as in PromptBERT's code; the sentence is also cut so that the whole sequence fits
        :meth:`model_max_tokens`, and the template is never cut. With ``append_eos`` every sequence ends with the
        tokenizer's EOS (appended unless already last; the text is cut one token earlier so the EOS always fits;
        with a template it counts as one of the template's tokens).
        """
        check_sentences(sentences)
        self.check_max_length(max_length)
        max_length = max_length or self.max_length
        tpl = self._resolve_template(template)
        if tpl is None and max_length is not None:
            self._check_room_for_text(max_length)
        if tpl is not None:
            ids = wrap_batch(self.tokenizer, tpl, list(sentences), max_length, self.model_max_tokens())
        elif self.append_eos:
            limit = max_length or self.model_max_tokens()
            ids = self.tokenizer(sentences, truncation=True, max_length=limit)["input_ids"]
            ids = [end_with_eos(row, self._eos_id, limit) for row in ids]
        else:
            return dict(self.tokenizer(sentences, padding=True, truncation=True,
                                       max_length=max_length or self.model_max_tokens(), return_tensors="pt"))
        return dict(self.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt"))

    def special_tokens(self) -> list[int]:
        """The token ids an empty sentence becomes without a template: the special tokens the tokenizer adds to
        every sentence (and the EOS with ``append_eos``). Computed once."""
        if self._special_tokens is None:
            empty = list(self.tokenizer("")["input_ids"])
            self._special_tokens = end_with_eos(empty, self._eos_id, len(empty) + 1) if self.append_eos else empty
        return list(self._special_tokens)

    def _check_room_for_text(self, max_length: int) -> None:
        """ValueError when ``max_length`` (special tokens included) leaves no token of text: every sentence would be
        the tokenizer's special tokens alone and encode to one vector (``max_length=2`` on BERT: ``[CLS] [SEP]``)."""
        special = len(self.special_tokens())
        if max_length <= special:
            raise ValueError(f"max_length={max_length} leaves no room for text: {self.base_model}'s tokenizer adds "
                             f"{special} special token(s) to every sentence, so every sentence would be "
                             f"those alone and encode to the same vector; set max_length >= {special + 1}"
                             " (it counts the special tokens)")

    @torch.inference_mode()
    def encode(self, sentences: list[str], batch_size: int = 64, normalize: bool = True,
               show_progress_bar: bool | None = None, max_length: int | None = None,
               convert_to_numpy: bool = True, *, task_metadata=None, hf_split: str | None = None,
               hf_subset: str | None = None, prompt_type=None, precision: str | None = None, dim: int | None = None,
               **kwargs):
        """Embed sentences; returns (N, hidden) vectors in input order (L2-normalised by default).

        ``dim``: keep the first ``dim`` coordinates of each vector (then L2-normalise, by default): a Matryoshka
        embedding of a prompt trained with ``matryoshka_dims`` (sentence-transformers' ``truncate_dim``).

        Batches are formed in :meth:`encoding_order` (by token count), so little padding is computed.
        The keywords evaluation harnesses pass are accepted: MTEB's ``task_metadata``, ``hf_split``, ``hf_subset``
        and ``prompt_type`` (a prompt's embedding does not depend on them), ``precision`` ("float32" only); any
        other keyword is ignored with a warning.
        """
        if precision not in (None, "float32"):
            raise ValueError(f"precision {precision!r} is not supported: embeddings are float32")
        if kwargs:
            logger.warning("encode ignores the keyword arguments %s", ", ".join(sorted(kwargs)))
        check_sentences(sentences)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim must be a positive integer (the coordinates to keep), got {shown(dim)}")
        if show_progress_bar is None:
            show_progress_bar = len(sentences) > batch_size and sys.stderr.isatty()
        was_training = self.training
        self.eval()
        try:
            order = self.encoding_order(sentences, max_length)
            chunks = []
            for start in tqdm(range(0, len(order), batch_size), desc="encode", disable=not show_progress_bar):
                batch = [sentences[i] for i in order[start:start + batch_size]]
                inputs = self.tokenize(batch, max_length)
                lengths = None  # a padded forward reads none (and a compiled one would recompile per list length)
                if self.packed:
                    with host_side():  # the tokenizer's fresh CPU tensor: the packed forward reads no mask back
                        lengths = inputs["attention_mask"].sum(1).tolist()
                inputs = {k: v.to(self.device) for k, v in inputs.items()}
                emb = self(inputs["input_ids"], inputs["attention_mask"], inputs.get("token_type_ids"),
                           lengths=lengths).float()
                if dim is not None:
                    if dim > emb.shape[1]:
                        raise ValueError(f"dim={dim} is more than the {emb.shape[1]} dimensions of the embeddings")
                    emb = emb[:, :dim]
                chunks.append(F.normalize(emb, dim=-1) if normalize else emb)
            out = torch.empty(len(sentences), chunks[0].shape[1], dtype=torch.float32, device=chunks[0].device)
            out[torch.as_tensor(order, device=out.device)] = torch.cat(chunks)
        finally:
            self.train(was_training)
        bad = (~torch.isfinite(out).all(dim=1)).nonzero().flatten().tolist()
        if bad:  # a vector of NaNs ranks and compares as garbage downstream: never hand one out
            raise ValueError(f"{len(bad)} of {len(sentences)} sentences encode to NaN or infinite vectors (the first: "
                             f"sentence {bad[0]}, {shown(sentences[bad[0]])}): the prompt or the backbone holds "
                             "non-finite values (from a run that diverged?); load an earlier checkpoint")
        return out.cpu().numpy() if convert_to_numpy else out

    def encoding_order(self, sentences: list[str], max_length: int | None = None) -> np.ndarray:
        """The order :meth:`encode` batches ``sentences`` in: by token count, longest first (ties in input order),
        so the rows of a batch are about equally long and little padding is computed. The sentences are tokenised
        in chunks to count their tokens (fast next to the model). Ordered by characters instead, about a quarter of
        the positions of STS batches were padding: digits and punctuation take more tokens than their length
        suggests (measured over the seven STS tasks, 32 tokens, batches of 64: 76% real tokens with MiniLM's
        tokenizer, 69% with SmolLM2's; by token count, 99.8%)."""
        counts = [self.tokenize(sentences[i:i + 4096], max_length)["attention_mask"].sum(1)
                  for i in range(0, len(sentences), 4096)]
        return np.argsort(-torch.cat(counts).numpy(), kind="stable")

    def similarity(self, a: list[str] | str, b: list[str] | str, batch_size: int = 64) -> np.ndarray:
        """Cosine similarity matrix (len(a), len(b)) between two lists of sentences."""
        a = [a] if isinstance(a, str) else a
        b = [b] if isinstance(b, str) else b
        return self.encode(a, batch_size) @ self.encode(b, batch_size).T


def check_sentences(sentences):
    if isinstance(sentences, str):
        raise TypeError("expected a list of sentences, got a single string (wrap it in a list)")
    if not isinstance(sentences, (list, tuple)):
        raise TypeError(f"expected a list of sentences, got {type(sentences).__name__}")
    if len(sentences) == 0:
        raise ValueError("no sentences to encode: the list is empty")
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise TypeError(f"sentence {i} is a {type(s).__name__}, not a str: {s!r:.80}")

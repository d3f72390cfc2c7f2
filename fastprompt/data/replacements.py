"""Corrupted sentences for replaced-token detection (D2CSE's conditional RTD, DiffCSE's conditional ELECTRA).

A share ``masking_ratio`` of each sentence's real, non-special tokens is chosen; a frozen **generator** puts a
token in each chosen position; the label of every real token says whether it now differs from the original
(1: replaced, 0: original). Two generators:

- :class:`MaskedLMGenerator`: a Hugging Face masked language model (DistilBERT in D2CSE and DiffCSE; any
  local path). The chosen positions are replaced by the mask token, the model reads the masked sentence, and
  each chosen position gets a token *sampled* from its MLM distribution there (``sampling="sample"``, ELECTRA's
  and D2CSE's description) or its most likely token (``"argmax"``, what DiffCSE's code does). A sample equal to
  the original token is labelled original. Logits are computed at the chosen positions only.
- :class:`RandomGenerator`: a uniformly random non-special token of the vocabulary. Not a paper's generator:
  for a backbone with no masked LM of its vocabulary available offline (see ``docs/crtd.md``).

Replacements are made on the fly (:meth:`ReplacementGenerator.corrupt` on every batch, on the term's seeded
generator) or ahead of training into a file (:func:`write_replacement_file`, the ``fastprompt
make-replacements`` command): one JSON line per distinct tokenised sentence, ``{"ids": [...], "replaced":
[...]}``, each line's randomness seeded by (seed, its token ids), so the file does not depend on the order
or the chunking of the run that wrote it and a killed run resumes where it stopped.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from fastprompt.choices import RTD_SAMPLING, check_choice

logger = logging.getLogger(__name__)

REPLACEMENT_FORMAT = "fastprompt-replacements"


def _special_ids(tokenizer) -> torch.Tensor:
    return torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)


def choose_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor, special_ids: torch.Tensor,
                     ratio: float, generator: torch.Generator) -> torch.Tensor:
    """(rows, S) bool: each real, non-special token chosen independently with probability ``ratio``."""
    eligible = attention_mask.bool() & ~torch.isin(input_ids, special_ids)
    return (torch.rand(input_ids.shape, generator=generator) < ratio) & eligible


def rtd_labels(original: torch.Tensor, corrupted: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """1 where a real token differs from the original, 0 where it equals it, -100 for padding and position 0
    (the discriminator's conditional slot: its input is the sentence embedding, not a token)."""
    labels = (corrupted != original).long()
    labels = labels.masked_fill(~attention_mask.bool(), -100)
    labels[:, 0] = -100
    return labels


class ReplacementGenerator:
    """Base: :meth:`replace` fills the chosen positions; :meth:`corrupt` chooses them and labels the result."""

    def __init__(self, tokenizer, masking_ratio: float):
        if not 0 < masking_ratio < 1:
            raise ValueError(f"masking_ratio must be in (0, 1), got {masking_ratio}")
        self.masking_ratio = masking_ratio
        self.special_ids = _special_ids(tokenizer)
        self.vocab_size = len(tokenizer)

    def replace(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, chosen: torch.Tensor,
                generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def corrupt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, S) CPU token ids -> (corrupted ids, labels): see :func:`rtd_labels`."""
        chosen = choose_positions(input_ids, attention_mask, self.special_ids, self.masking_ratio, generator)
        corrupted = self.replace(input_ids, attention_mask, chosen, generator)
        return corrupted, rtd_labels(input_ids, corrupted, attention_mask)


class RandomGenerator(ReplacementGenerator):
    """Uniformly random non-special tokens at the chosen positions (no model; see the module docstring)."""

    def replace(self, input_ids, attention_mask, chosen, generator):
        allowed = torch.ones(self.vocab_size, dtype=torch.bool)
        allowed[self.special_ids[self.special_ids < self.vocab_size]] = False
        pool = allowed.nonzero().squeeze(1)
        draw = pool[torch.randint(len(pool), input_ids.shape, generator=generator)]
        return torch.where(chosen, draw, input_ids)


class MaskedLMGenerator(ReplacementGenerator):
    """A frozen Hugging Face masked LM: samples (or the argmax) of its distribution at the masked positions.

    ``model``: an ``AutoModelForMaskedLM``; ``tokenizer``: the *backbone's* tokenizer (the generator must share
    its vocabulary: checked on size and on the mask token). ``device``: where the generator runs.
    """

    def __init__(self, model, tokenizer, masking_ratio: float, sampling: str = "sample",
                 device: torch.device | str = "cpu"):
        super().__init__(tokenizer, masking_ratio)
        check_choice("sampling", sampling, RTD_SAMPLING)
        if tokenizer.mask_token_id is None:
            raise ValueError("the backbone's tokenizer has no mask token: a masked-LM generator cannot read it")
        gen_vocab = model.get_output_embeddings().weight.shape[0]
        if gen_vocab < self.vocab_size:
            raise ValueError(f"the generator's vocabulary ({gen_vocab} tokens) is not the backbone's "
                             f"({self.vocab_size}); use a generator trained with the backbone's tokenizer "
                             "(DistilBERT for BERT, DistilRoBERTa for RoBERTa)")
        self.model = model.eval().requires_grad_(False).to(device)
        self.mask_token_id, self.sampling, self.device = tokenizer.mask_token_id, sampling, torch.device(device)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, tokenizer, masking_ratio: float, sampling: str = "sample",
                        device: torch.device | str = "cpu") -> "MaskedLMGenerator":
        from transformers import AutoModelForMaskedLM

        try:
            model = AutoModelForMaskedLM.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the masked-LM generator {str(path)!r}: {e}".splitlines()[0]) from None
        return cls(model, tokenizer, masking_ratio, sampling, device)

    def replace(self, input_ids, attention_mask, chosen, generator):
        masked = torch.where(chosen, self.mask_token_id, input_ids)
        out = self.model.base_model(input_ids=masked.to(self.device), attention_mask=attention_mask.to(self.device))
        hidden = out.last_hidden_state[chosen.to(self.device)]
        logits = self._head_logits(hidden).float()[:, :self.vocab_size]
        logits[:, self.special_ids[self.special_ids < self.vocab_size].to(logits.device)] = float("-inf")
        if self.sampling == "argmax":
            picked = logits.argmax(-1).cpu()
        else:
            picked = torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator).squeeze(1)
        corrupted = input_ids.clone()
        corrupted[chosen] = picked
        return corrupted

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of some positions' last hidden states through the model's own MLM head."""
        m = self.model
        if hasattr(m, "cls"):  # BertForMaskedLM
            return m.cls(hidden)
        if hasattr(m, "lm_head"):  # RobertaForMaskedLM and relatives
            return m.lm_head(hidden)
        if hasattr(m, "vocab_projector"):  # DistilBertForMaskedLM
            x = m.vocab_layer_norm(m.activation(m.vocab_transform(hidden)))
            return m.vocab_projector(x)
        raise ValueError(f"{type(m).__name__}: unknown masked-LM head layout (expected BERT's cls, RoBERTa's "
                         "lm_head or DistilBERT's vocab_projector)")


def build_generator(spec: str, tokenizer, masking_ratio: float, sampling: str = "sample",
                    device: torch.device | str = "cpu") -> ReplacementGenerator:
    """``spec``: ``"random"`` or the path of a Hugging Face masked LM."""
    if spec == "random":
        return RandomGenerator(tokenizer, masking_ratio)
    return MaskedLMGenerator.from_pretrained(spec, tokenizer, masking_ratio, sampling, device)


# ---------------------------------------------------------------- ahead of training


def sentence_seed(seed: int, ids: Iterable[int]) -> int:
    """The seed of one tokenised sentence's replacements (independent of the order sentences are processed in)."""
    words = np.asarray(list(ids), dtype=np.int64).tobytes()
    return int(np.random.SeedSequence([int(seed), zlib.crc32(words), len(words)]).generate_state(1)[0])


def _read_lines(path: Path) -> dict[tuple[int, ...], list[int]]:
    table = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                ids, rep = tuple(int(i) for i in rec["ids"]), [int(i) for i in rec["replaced"]]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: not a line of a replacement file (expected "
                                 '{"ids": [...], "replaced": [...]})') from None
            if len(ids) != len(rep):
                raise ValueError(f"{path}:{n}: ids and replaced have different lengths")
            table[ids] = rep
    return table


def _meta_path(path: Path) -> Path:
    return Path(f"{path}.meta.json")


def write_replacement_file(path: str | os.PathLike, sentences: list[list[int]], gen: ReplacementGenerator, *,
                           seed: int, settings: dict, chunk_size: int = 64) -> int:
    """Append the replacements of every tokenised sentence not in ``path`` yet; returns how many were added.

    ``sentences``: token ids without padding. ``settings`` (generator, ratio, tokenizer, max length, seed) go in
    ``path.meta.json``; resuming with other settings is refused. Each line is written with one ``write()`` of
    the complete line, so a killed run leaves at most a torn last line, cut off on the next run.
    """
    from fastprompt.data.ski.store import drop_torn_tail
    from fastprompt.io import read_json, write_json_atomic

    path = Path(path)
    meta = _meta_path(path)
    settings = {"format": REPLACEMENT_FORMAT, **settings, "seed": int(seed)}
    if path.exists():
        if not meta.exists():
            raise ValueError(f"{path} exists without {meta.name}: not a replacement file (choose another output)")
        old = read_json(meta, "replacement settings")
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise ValueError(f"{path} was written with other settings ({', '.join(diff)}); use another output")
        dropped = drop_torn_tail(path)
        if dropped:
            logger.warning("%s: dropped a torn last line (%d bytes) of an interrupted run", path, dropped)
        done = set(_read_lines(path))
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(meta, settings)
        done = set()
    todo = list(dict.fromkeys(tuple(s) for s in sentences if tuple(s) not in done))
    logger.info("replacements: %d sentences done, %d to go", len(done), len(todo))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for start in range(0, len(todo), chunk_size):
            for ids in todo[start:start + chunk_size]:
                g = torch.Generator().manual_seed(sentence_seed(seed, ids))
                x = torch.tensor([ids])
                corrupted, _ = gen.corrupt(x, torch.ones_like(x), g)
                line = json.dumps({"ids": list(ids), "replaced": corrupted[0].tolist()}, separators=(",", ":"))
                os.write(fd, (line + "\n").encode())
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(todo)


class ReplacementTable:
    """A replacement file joined onto training batches by each row's token ids."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"replacement file {self.path} does not exist; write it with `fastprompt "
                             "make-replacements --config ...`")
        self.settings = dict(_read_meta(self.path))
        self.table = _read_lines(self.path)

    def __len__(self) -> int:
        return len(self.table)

    def corrupt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The file's corrupted ids for (rows, S) right-padded ids, and their labels (:func:`rtd_labels`)."""
        corrupted = input_ids.clone()
        lengths = attention_mask.sum(1).tolist()
        missing = 0
        for r, n in enumerate(lengths):
            rep = self.table.get(tuple(input_ids[r, :n].tolist()))
            if rep is None:
                missing += 1
                continue
            corrupted[r, :n] = torch.tensor(rep)
        if missing:
            raise ValueError(f"{missing} of {len(lengths)} rows of a batch are not in {self.path}: it was made for "
                             f"other data or tokenisation ({self.settings}); rerun `fastprompt make-replacements` "
                             "with the training config")
        return corrupted, rtd_labels(input_ids, corrupted, attention_mask)


def _read_meta(path: Path) -> dict:
    from fastprompt.io import read_json

    meta = _meta_path(path)
    if not meta.exists():
        raise ValueError(f"{path}: no {meta.name} beside it; not a file written by `fastprompt make-replacements`")
    return read_json(meta, "replacement settings")

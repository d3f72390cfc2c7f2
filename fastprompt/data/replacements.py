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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fastprompt.choices import RTD_SAMPLING, check_choice
from fastprompt.io import check_file, read_json, write_json_atomic
from fastprompt.schema import check_json

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

    @torch.no_grad()
    def corrupt_each(self, sentences: list[list[int]], generators: list[torch.Generator]) -> list[list[int]]:
        """Each unpadded sentence corrupted on its own generator: by definition what :meth:`corrupt` gives one
        sentence at a time (``ids`` as a (1, len) batch with every token real). Subclasses with a model batch
        the work without changing the result."""
        out = []
        for ids, g in zip(sentences, generators, strict=True):
            x = torch.tensor([ids])
            out.append(self.corrupt(x, torch.ones_like(x), g)[0][0].tolist())
        return out


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
                        device: torch.device | str = "cpu", trust_remote_code: bool = False) -> "MaskedLMGenerator":
        from transformers import AutoModelForMaskedLM

        from fastprompt.model.backbone import check_model_folder
        from fastprompt.remote_code import refusing_remote_code

        try:
            if Path(path).is_dir():
                check_model_folder(path, tokenizer=False)  # config types, safetensors only (it reads the encoder's ids)
            with refusing_remote_code(path, trust_remote_code):
                model, info = AutoModelForMaskedLM.from_pretrained(path, output_loading_info=True, use_safetensors=True,
                                                                   trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the masked-LM generator {str(path)!r}: {e}".splitlines()[0]) from None
        prefix = f"{model.base_model_prefix}."
        head = [k for k in info.get("missing_keys") or [] if not k.startswith(prefix)
                and not k.endswith("decoder.weight")]  # the decoder is tied to the word embeddings
        if head:  # transformers initialised the MLM head at random: its "replacements" would be noise
            raise ValueError(f"the masked-LM generator {str(path)!r} has no masked-LM head in its weights (missing "
                             f"{', '.join(sorted(head)[:3])}, ...): a random head would pick the replacements; use a "
                             "checkpoint saved from a *ForMaskedLM model (D2CSE: distilbert-base-uncased), or "
                             "rtd_generator=random")
        return cls(model, tokenizer, masking_ratio, sampling, device)

    def replace(self, input_ids, attention_mask, chosen, generator):
        picked = self._pick(self._scores(input_ids, attention_mask, chosen), generator)
        corrupted = input_ids.clone()
        corrupted[chosen] = picked
        return corrupted

    @torch.no_grad()
    def corrupt_each(self, sentences, generators, max_rows: int = 64):
        """One generator forward per group of up to ``max_rows`` sentences **of the same length** (no padding,
        so each sentence's positions are computed as in its own forward), each sentence's positions and
        samples still drawn from its own generator in the order :meth:`corrupt` draws them."""
        if len(sentences) != len(generators):
            raise ValueError(f"{len(sentences)} sentences but {len(generators)} generators")
        chosen = [choose_positions(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), self.special_ids,
                                   self.masking_ratio, g)[0] for ids, g in zip(sentences, generators)]
        out: list[list[int] | None] = [None] * len(sentences)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(sentences):
            by_length.setdefault(len(ids), []).append(i)
        for rows in by_length.values():
            for start in range(0, len(rows), max_rows):
                group = rows[start:start + max_rows]
                ids = torch.tensor([sentences[i] for i in group])
                mask = torch.stack([chosen[i] for i in group])
                scores = self._scores(ids, torch.ones_like(ids), mask)
                counts = mask.sum(1).tolist()
                for i, row, part in zip(group, ids, scores.split(counts)):
                    corrupted = row.clone()
                    corrupted[chosen[i]] = self._pick(part, generators[i])
                    out[i] = corrupted.tolist()
        return out

    def _scores(self, input_ids, attention_mask, chosen) -> torch.Tensor:
        """(chosen positions, vocab) float32: logits for ``argmax``, probabilities on the CPU for ``sample``;
        special tokens excluded."""
        masked = torch.where(chosen, self.mask_token_id, input_ids)
        out = self.model.base_model(input_ids=masked.to(self.device), attention_mask=attention_mask.to(self.device))
        hidden = out.last_hidden_state[chosen.to(self.device)]
        logits = self._head_logits(hidden).float()[:, :self.vocab_size]
        logits[:, self.special_ids[self.special_ids < self.vocab_size].to(logits.device)] = float("-inf")
        return logits if self.sampling == "argmax" else logits.softmax(-1).cpu()

    def _pick(self, scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.sampling == "argmax":
            return scores.argmax(-1).cpu()
        return torch.multinomial(scores, 1, generator=generator).squeeze(1)

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
                    device: torch.device | str = "cpu", trust_remote_code: bool = False) -> ReplacementGenerator:
    """``spec``: ``"random"`` or the path of a Hugging Face masked LM (whose own code runs only with
    ``trust_remote_code``)."""
    if spec == "random":
        return RandomGenerator(tokenizer, masking_ratio)
    return MaskedLMGenerator.from_pretrained(spec, tokenizer, masking_ratio, sampling, device, trust_remote_code)


# ---------------------------------------------------------------- ahead of training


def sentence_seed(seed: int, ids: Iterable[int]) -> int:
    """The seed of one tokenised sentence's replacements (independent of the order sentences are processed in)."""
    words = np.asarray(list(ids), dtype=np.int64).tobytes()
    return int(np.random.SeedSequence([int(seed), zlib.crc32(words), len(words)]).generate_state(1)[0])


@dataclass
class ReplacementLine:
    """The schema of one line of a replacement file (:mod:`fastprompt.schema`)."""

    ids: list[int]
    replaced: list[int]


#: Token ids are int32 in the table (vocabularies are far below 2**31).
_MAX_ID = 2**31 - 1


def _read_lines(path: Path) -> Iterator[tuple[list[int], list[int]]]:
    """(ids, replaced) of every line of a replacement file, checked: types, lengths and the id range."""
    with open(check_file(path, "replacement file"), "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"replacement file {path}:{n}"
            try:
                rec = json.loads(raw)
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                raise ValueError(f"{where}: not a line of a replacement file (expected "
                                 '{"ids": [...], "replaced": [...]})') from None
            check_json(rec, ReplacementLine, where)
            ids, rep = rec["ids"], rec["replaced"]
            if len(ids) != len(rep):
                raise ValueError(f"{where}: ids and replaced have different lengths")
            if any(not 0 <= i <= _MAX_ID for i in (*ids, *rep)):
                raise ValueError(f"{where}: a token id outside [0, {_MAX_ID}]")
            yield ids, rep


def _key(ids) -> bytes:
    """A tokenised sentence as a compact dictionary key (int32 bytes; vocabularies are far below 2**31)."""
    return np.asarray(ids, dtype=np.int32).tobytes()


def _changes(ids: list[int], rep: list[int]) -> bytes:
    """The replaced positions and their tokens only, as int32 bytes (positions, then tokens)."""
    a, b = np.asarray(ids, dtype=np.int32), np.asarray(rep, dtype=np.int32)
    where = np.flatnonzero(a != b).astype(np.int32)
    return np.concatenate([where, b[where]]).tobytes()


def replacement_settings(rtd, model: str | None, max_length: int) -> dict:
    """What a replacement file records about how it was made, from a config's ``rtd`` section
    (:class:`~fastprompt.methods.crtd.config.CRTDConfig`), the backbone (``PromptEncoder.base_model``: an
    absolute folder path, a model package's name or a hub id) and the tokenisation's ``max_length``."""
    return {"generator": rtd.generator, "masking_ratio": rtd.masking_ratio, "sampling": rtd.sampling,
            "model": None if model is None else str(model), "max_length": max_length}


def check_replacement_settings(made: dict, rtd, model: str | None, path) -> None:
    """A clear ``ValueError`` when the file at ``path`` (settings ``made``) was made for another generator,
    masking ratio, sampling mode (masked-LM generators only: ``random`` has none) or backbone than training
    asks for. Tokenisation (``max_length``, a template) is checked row by row when batches are joined."""
    from fastprompt.model.resolve import model_reference

    asked = replacement_settings(rtd, model, made.get("max_length"))
    keys = ["generator", "masking_ratio", "model"] + (["sampling"] if rtd.generator != "random" else [])
    made = dict(made)
    if made.get("model") is None or model is None:  # the backbone is not known on one side: nothing to compare
        keys.remove("model")
    else:  # a folder recorded as a relative path (files of earlier versions) compares by its absolute path
        try:
            made["model"] = model_reference(made["model"])
        except (OSError, ValueError):
            pass
    diff = [k for k in keys if made.get(k) != asked[k]]
    if diff:
        raise ValueError(f"{path} was made with " + ", ".join(f"{k}={made.get(k)!r}" for k in diff)
                         + "; the config asks for " + ", ".join(f"{k}={asked[k]!r}" for k in diff)
                         + ": run `fastprompt make-replacements` with the training config")


@dataclass
class ReplacementSettings:
    """The schema of ``FILE.meta.json`` beside a replacement file (:func:`replacement_settings`, the format and the
    seed)."""

    generator: str | None = None
    masking_ratio: float | None = None
    model: str | None = None
    max_length: int | None = None
    sampling: str | None = None
    format: str | None = None
    seed: int | None = None


def _meta_path(path: Path) -> Path:
    return Path(f"{path}.meta.json")


def write_replacement_file(path: str | os.PathLike, sentences: list[list[int]], gen: ReplacementGenerator, *,
                           seed: int, settings: dict, chunk_size: int = 64) -> int:
    """Append the replacements of every tokenised sentence not in ``path`` yet; returns how many were added.

    ``sentences``: token ids without padding. ``settings`` (generator, ratio, tokenizer, max length, seed) go in
    ``path.meta.json``; resuming with other settings is refused. Each line is written with one ``write()`` of
    the complete line, so a killed run leaves at most a torn last line, cut off on the next run.
    ``chunk_size`` sentences go through the generator at a time (:meth:`ReplacementGenerator.corrupt_each`:
    a masked LM batches the sentences of equal length), each on its own seeded generator, so the lines are
    those of one sentence at a time.
    """
    from fastprompt.io import drop_torn_tail

    path = Path(path)
    meta = _meta_path(path)
    settings = {"format": REPLACEMENT_FORMAT, **settings, "seed": int(seed)}
    if path.exists():
        if not meta.exists():
            raise ValueError(f"{path} exists without {meta.name}: not a replacement file (choose another output)")
        old = read_json(meta, "replacement settings", schema=ReplacementSettings)
        if old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            raise ValueError(f"{path} was written with other settings ({', '.join(diff)}); use another output")
        dropped = drop_torn_tail(path)
        if dropped:
            logger.warning("%s: dropped a torn last line (%d bytes) of an interrupted run", path, dropped)
        done = {_key(ids) for ids, _ in _read_lines(path)}
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(meta, settings)
        done = set()
    todo = list(dict.fromkeys(tuple(s) for s in sentences if _key(s) not in done))
    logger.info("replacements: %d sentences done, %d to go", len(done), len(todo))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start:start + chunk_size]
            generators = [torch.Generator().manual_seed(sentence_seed(seed, ids)) for ids in chunk]
            for ids, replaced in zip(chunk, gen.corrupt_each([list(ids) for ids in chunk], generators)):
                line = json.dumps({"ids": list(ids), "replaced": replaced}, separators=(",", ":"))
                os.write(fd, (line + "\n").encode())
            os.fsync(fd)
    finally:
        os.close(fd)
    return len(todo)


class ReplacementTable:
    """A replacement file joined onto training batches by each row's token ids.

    In memory each sentence is one ``bytes`` key (its ids as int32) and one ``bytes`` value (the replaced
    positions and their tokens only, int32): about 4·len + 8·replaced bytes of data plus two bytes objects'
    overhead, against a pointer per token in a tuple and a list plus a 28-byte int object per token id above
    256. Measured with ``tracemalloc`` for 20,000 sentences of 20 tokens (random ids, 30% of the inner
    tokens replaced): 29.7 MB as tuples and lists, 4.4 MB (~220 bytes a sentence) as here;
    ``tests/methods/crtd/test_replacements.py::test_the_table_is_compact`` bounds it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"replacement file {self.path} does not exist; write it with `fastprompt "
                             "make-replacements --config ...`")
        self.settings = dict(_read_meta(self.path))
        self.table = {_key(ids): _changes(ids, rep) for ids, rep in _read_lines(self.path)}

    def __len__(self) -> int:
        return len(self.table)

    def corrupt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The file's corrupted ids for (rows, S) right-padded ids, and their labels (:func:`rtd_labels`)."""
        corrupted = input_ids.clone()
        lengths = attention_mask.sum(1).tolist()
        missing = 0
        for r, n in enumerate(lengths):
            rep = self.table.get(_key(input_ids[r, :n].cpu().numpy()))
            if rep is None:
                missing += 1
                continue
            changes = torch.from_numpy(np.frombuffer(rep, dtype=np.int32).astype(np.int64)).view(2, -1)
            corrupted[r, changes[0]] = changes[1]
        if missing:
            raise ValueError(f"{missing} of {len(lengths)} rows of a batch are not in {self.path}: it was made for "
                             f"other data or tokenisation ({self.settings}); rerun `fastprompt make-replacements` "
                             "with the training config")
        return corrupted, rtd_labels(input_ids, corrupted, attention_mask)


def _read_meta(path: Path) -> dict:
    meta = _meta_path(path)
    if not meta.exists():
        raise ValueError(f"{path}: no {meta.name} beside it; not a file written by `fastprompt make-replacements`")
    return read_json(meta, "replacement settings", schema=ReplacementSettings)

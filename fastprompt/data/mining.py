"""Hard-negative mining (``fastprompt mine-negatives``): query/positive rows in, the JSONL of
:mod:`fastprompt.data.retrieval` out, with negatives found by a (prompted) encoder.

FlagEmbedding's ``hn_mine`` recipe, exact: every candidate text is encoded once (L2-normalised), each query's top
``hi`` candidates by cosine are found exactly, in chunks of queries (``chunk_size`` x candidates similarities at a
time, with a tqdm bar), the query itself and its positives are dropped, so is every candidate scoring above the
query's positive minus ``margin`` (sentence-transformers' ``mine_hard_negatives`` margin filter: a candidate that
close to the positive is likely an unlabelled positive), and ``negatives`` of the ranks ``[lo, hi)`` that remain are
drawn (FlagEmbedding's ``range_for_sampling``: skipping the very top avoids false negatives), seeded by ``seed`` and
the row's position, so any row's draw is reproducible. A row with fewer candidates left gets fewer negatives (the
trainer's ``negatives_per_row`` + ``pad_negatives`` handle ragged counts).

Bounded: the options are checked before anything is read or written; the candidate files are streamed a bounded line
at a time (:func:`read_candidates`), and refused with the count that fits once their texts and embeddings would
outgrow the memory available; before encoding, the memory of the candidate embeddings and of one chunk's similarity
block is estimated (:func:`check_mining_memory`) and a ``chunk_size`` too large for it is refused with one that fits.

Resumable: the candidate embeddings are written :data:`CACHE_CHUNK` at a time into ``<output>.cache/`` (one ``.npy``
per chunk, each written atomically), the output is appended row by row (a torn last line from a killed run is
dropped), and ``<output>.meta.json`` records the settings: the mining options, hashes of the queries and candidates,
and everything that decides a vector (:func:`encoder_identity`: the model, a SHA-256 of all its weights and of its
tokenizer, the pooler, max length, template, prompt, dtype, ...). Running the same command again continues where it
stopped; other settings (or other candidates, or weights changed in place) are refused, naming what differs, rather
than mixed in. ``chunk_size`` decides neither a vector nor a draw: a resumed run may use another.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fastprompt.data.corpus import text_lines
from fastprompt.data.retrieval import MAX_TEXTS_PER_ROW, QueryRows
from fastprompt.io import atomic_file, check_file, read_json, write_json_atomic
from fastprompt.model.device import available_bytes, size_text

logger = logging.getLogger(__name__)

#: Candidate texts per embedding-cache file (fixed, so that ``chunk_size`` can change on resume).
CACHE_CHUNK = 4096
#: The largest seed (the trainer's bound, ``numpy.random.default_rng`` takes any non-negative integer).
MAX_SEED = 2**32 - 1
#: Python's memory per candidate besides its text and embedding (measured on CPython 3.11: the str header, the slots
#: of the candidate lists and the entries of the de-duplication and text -> position dicts), an estimate.
CANDIDATE_OVERHEAD = 200
#: What the options are called on the command line, for the message that names a setting a resume changes.
OPTION_NAMES = {
    "model": "--model", "weights_sha256": "the model's weights", "tokenizer_sha256": "the model's tokenizer",
    "pooler": "--pooler", "mlp": "the prompt's mlp", "pooler_head": "the prompt's pooler head",
    "max_length": "--max-length", "template": "--template", "denoise": "--denoise", "topk": "--topk",
    "append_eos": "--append-eos", "prompt_config": "--prompt", "dtype": "--dtype",
    "lo": "--range-for-sampling", "hi": "--range-for-sampling", "negatives": "--negatives", "margin": "--margin",
    "seed": "--seed", "candidates_sha256": "the candidates (--input's positives and negatives, --candidates)",
    "queries_sha256": "the queries and positives of --input", "cache_chunk": "the embedding cache's layout",
}


def check_mining_options(*, lo: int, hi: int, negatives: int, margin: float | None, seed: int,
                         chunk_size: int) -> None:
    """ValueError for an option no run can use, before anything is read or written (the command line's types check
    the same)."""
    def integer(x) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool)

    if not (integer(lo) and integer(hi) and 0 <= lo < hi):
        raise ValueError(f"range_for_sampling must be lo-hi with 0 <= lo < hi, got {lo}-{hi}")
    if not integer(negatives) or not 1 <= negatives <= MAX_TEXTS_PER_ROW:
        raise ValueError(f"negatives must be in [1, {MAX_TEXTS_PER_ROW}] (a row read back has at most "
                         f"{MAX_TEXTS_PER_ROW}), got {negatives}")
    if margin is not None and not (isinstance(margin, (int, float)) and math.isfinite(margin) and -2 <= margin <= 2):
        raise ValueError(f"margin must be a finite number in [-2, 2] (a difference of cosines), got {margin}")
    if not integer(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, {MAX_SEED}], got {seed}")
    if not integer(chunk_size) or chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


@dataclass(frozen=True)
class MiningSettings:
    """What decides the mined negatives (recorded in ``<output>.meta.json``; a resumed run must match)."""

    model: str
    lo: int = 10
    hi: int = 100
    negatives: int = 15
    margin: float | None = None
    seed: int = 0
    candidates_sha256: str = ""
    queries_sha256: str = ""
    #: everything that decides a vector (:func:`encoder_identity`)
    encoder: dict = field(default_factory=dict)
    cache_chunk: int = CACHE_CHUNK

    def check(self) -> None:
        check_mining_options(lo=self.lo, hi=self.hi, negatives=self.negatives, margin=self.margin, seed=self.seed,
                             chunk_size=1)

    def flat(self) -> dict:
        """The settings as one level of keys (the encoder's beside the mining options)."""
        out = asdict(self)
        return {**{k: v for k, v in out.items() if k != "encoder"}, **out["encoder"]}


def _sha(texts) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\x1e")
    return h.hexdigest()


def weights_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of every tensor of ``module``'s state dict (names, dtypes, shapes and bytes), one tensor at a time:
    all the weights, not a sample. Measured: 0.18 s for all-MiniLM-L6-v2's 91 MB (2 shared CPU cores, AMD EPYC),
    next to ~1 s to load it and minutes to encode a candidate pool."""
    h = hashlib.sha256()
    state = module.state_dict()
    for key in sorted(state):
        t = state[key].detach()
        h.update(f"{key}\x1f{t.dtype}\x1f{tuple(t.shape)}\x1e".encode())
        h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _tokenizer_sha256(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # a fast tokenizer: its whole definition, less the truncation and padding state that
        spec = json.loads(backend.to_str())  # the last call left behind (encode sets them per call)
        spec.pop("truncation", None)
        spec.pop("padding", None)
    else:
        spec = sorted(tokenizer.get_vocab().items())
    extra = [type(tokenizer).__name__, tokenizer.padding_side, tokenizer.truncation_side,
             getattr(tokenizer, "model_max_length", None)]
    text = json.dumps([spec, extra], sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def encoder_identity(encoder) -> dict:
    """Everything that decides ``encoder``'s vectors: for a :class:`~fastprompt.model.PromptEncoder`, the base model,
    a hash of all its weights (backbone, prompt, pooler head, MLM head) and of its tokenizer, the pooler, the
    max length it truncates to, the template, denoising, top-k, EOS, the prompt's configuration and the dtype (not
    the device or attention backend: they change rounding, not the model); for another ``torch.nn.Module``, its class
    and weights; otherwise its class alone."""
    # no import: an encoder can only be a PromptEncoder once its module is loaded (transformers takes seconds)
    prompt_encoder = getattr(sys.modules.get("fastprompt.model.encoder"), "PromptEncoder", None)
    if prompt_encoder is None or not isinstance(encoder, prompt_encoder):
        weights = weights_sha256(encoder) if isinstance(encoder, torch.nn.Module) else ""
        return {"model": type(encoder).__name__, "weights_sha256": weights}
    pooler = encoder.pooler
    return {
        "model": str(encoder.base_model),
        "weights_sha256": weights_sha256(encoder),
        "tokenizer_sha256": _tokenizer_sha256(encoder.tokenizer),
        "pooler": pooler.pooler, "mlp": pooler.mlp, "pooler_head": pooler.head_kind,
        "max_length": encoder.max_length or encoder.model_max_tokens(),
        "template": encoder.template, "denoise": encoder.denoise, "topk": encoder.topk,
        "append_eos": encoder.append_eos,
        "prompt_config": encoder.prompt_config.to_dict() if encoder.prompt_config is not None else None,
        "dtype": str(next(encoder.backbone.parameters()).dtype).removeprefix("torch."),
    }


def candidate_pool(rows: QueryRows, extra: list[str]) -> list[str]:
    """The candidates: every positive and negative of the rows, then the ``extra`` texts, each once, in order."""
    pool = [t for pos, neg in zip(rows.positives, rows.negatives) for t in (*pos, *neg)]
    return list(dict.fromkeys([*pool, *extra]))


def candidate_bytes(text: str, dim: int) -> int:
    """The memory one candidate takes while mining: its text, its ``dim`` float32 embedding and Python's
    bookkeeping (:data:`CANDIDATE_OVERHEAD`); an estimate."""
    return sys.getsizeof(text) + CANDIDATE_OVERHEAD + 4 * dim


def read_candidates(paths, *, dim: int, already: int = 0, available: int | None = None) -> list[str]:
    """The texts of the candidate files (one per line, stripped, empty lines skipped), streamed a bounded line at a
    time (:func:`fastprompt.data.corpus.text_lines`: a NUL byte is found on the line that holds it, a huge line is
    never read whole). A line that is not UTF-8 is an error naming it. ``already``: the bytes the pool holds before
    (the input's own texts); once those and the candidates read (:func:`candidate_bytes`, with their ``dim``-wide
    embeddings) would exceed ``available`` bytes (default: the memory available now), reading stops with a
    ValueError naming the count that fits."""
    available = available_bytes("cpu") if available is None else available
    texts: list[str] = []
    need = already
    for path in paths:
        path = check_file(path, "candidates file")
        for lineno, raw in text_lines(path):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line: {e.reason}); "
                                 "re-encode the file as UTF-8") from None
            text = (text.lstrip("\ufeff") if lineno == 1 else text).strip()
            if not text:
                continue
            need += candidate_bytes(text, dim)
            if available is not None and need > available:
                raise ValueError(
                    f"{path}:{lineno}: too many candidates for this machine's memory: mining keeps every candidate's "
                    f"text and its {dim}-dimensional embedding, about {size_text(need)} with the {len(texts) + 1} "
                    f"read so far, more than the {size_text(available)} available; mine against fewer candidates "
                    f"(at most about {len(texts)}: split the file, or take its first lines)")
            texts.append(text)
    return texts


def check_mining_memory(candidates: int, dim: int, *, chunk_size: int, queries: int, top: int,
                        available: int | None) -> int:
    """The memory mining will allocate for ``queries`` queries (the candidate embeddings, their text -> position map,
    and per chunk of queries its ``chunk_size`` x ``candidates`` float32 similarity block, its ``top`` best scores and
    indices and the query vectors); a ValueError naming the estimate and a ``chunk_size`` that fits when it exceeds
    ``available`` bytes (None: unknown, no check). Returns the estimate."""
    fixed = candidates * (4 * dim + CANDIDATE_OVERHEAD // 2)
    per_query = 4 * candidates + 12 * top + 8 * dim
    rows = min(chunk_size, queries)  # a chunk larger than the queries left allocates no more
    need = fixed + rows * per_query
    logger.info("estimated memory of mining: %s%s", size_text(need),
                f" of {size_text(available)} available" if available is not None else "")
    if available is None or need <= available:
        return need
    if fixed + per_query > available:
        raise ValueError(f"the embeddings of the {candidates} candidates ({dim} dimensions) need about "
                         f"{size_text(fixed)} of memory, with a chunk of one query {size_text(fixed + per_query)}, "
                         f"more than the {size_text(available)} available; mine against fewer candidates")
    fit = max(1, (available - fixed) // 2 // per_query)  # half the headroom: the encoder's activations come on top
    suggestion = 2 ** int(math.log2(fit))
    raise ValueError(f"--chunk-size {chunk_size} x {candidates} candidates needs about {size_text(need)} of memory "
                     f"({size_text(4 * rows * candidates)} of similarities per chunk of queries, "
                     f"{size_text(fixed)} of candidate embeddings), more than the {size_text(available)} available; "
                     f"use --chunk-size {suggestion}")


def embedding_dim(encoder, text: str) -> int:
    """The width of ``encoder``'s vectors, from encoding one text (exact whatever the pooler; an encoder that cannot
    run fails here, before any file is written)."""
    return int(np.asarray(encoder.encode([text], batch_size=1, show_progress_bar=False)).shape[1])


def encode_cached(encoder, texts: list[str], cache: Path, *, dim: int, batch_size: int,
                  show_progress_bar: bool | None, chunk: int = CACHE_CHUNK) -> np.ndarray:
    """(len(texts), dim) float32 normalised embeddings, ``chunk`` texts per cache file (existing files are reused),
    filled into one array allocated up front."""
    cache.mkdir(parents=True, exist_ok=True)
    out = np.empty((len(texts), dim), dtype=np.float32)
    starts = range(0, len(texts), chunk)
    for n, start in enumerate(tqdm(starts, desc="encode candidates", disable=show_progress_bar is False)):
        path = cache / f"emb-{n:06d}.npy"
        want = min(chunk, len(texts) - start)
        if path.is_file():
            part = np.load(path, allow_pickle=False)
            if part.shape != (want, dim):
                raise ValueError(f"{path} holds embeddings of shape {part.shape}, not {(want, dim)}: it was changed "
                                 f"since this run wrote it; delete {cache} (or pass --overwrite) to encode again")
        else:
            part = np.asarray(encoder.encode(texts[start:start + want], batch_size=batch_size,
                                             show_progress_bar=False), dtype=np.float32)
            with atomic_file(path, "embedding cache") as tmp:
                with open(tmp, "wb") as fh:
                    np.save(fh, part, allow_pickle=False)
        out[start:start + want] = part
    return out


def written_paths(output: str | os.PathLike) -> tuple[Path, Path, Path]:
    """Every path a mining run writes (or, with ``--overwrite``, deletes): the JSONL, its ``.meta.json`` and its
    ``.cache/`` folder. None of them may be an input."""
    output = Path(output)
    return output, output.with_name(output.name + ".meta.json"), output.with_name(output.name + ".cache")


def _done_rows(output: Path) -> int:
    """Complete lines already in ``output`` (a torn last line of a killed run is cut off first)."""
    from fastprompt.io import drop_torn_tail

    if not output.exists():
        return 0
    dropped = drop_torn_tail(output)
    if dropped:
        logger.warning("%s: dropped an incomplete last line (%d bytes) left by an interrupted run", output, dropped)
    with open(output, "rb") as fh:
        return sum(1 for _ in fh)


def _short(value) -> str:
    if value is None:
        return "not recorded"
    if isinstance(value, str) and len(value) == 64:  # a SHA-256
        return value[:12] + "..."
    text = json.dumps(value, sort_keys=True)
    return text[:40] + "..." if len(text) > 43 else text


def _check_resume(output: Path, settings: MiningSettings) -> None:
    """Refuse to continue ``output`` when its recorded settings differ (naming each setting), when it was not written
    by mining, or when a cache is there without settings. Reads only."""
    _, meta, cache = written_paths(output)
    if meta.is_file():
        before, now = read_json(meta, "mining settings"), settings.flat()
        recorded = before.pop("encoder", None)
        before.update(recorded if isinstance(recorded, dict) else {})
        changed = [k for k in now if before.get(k) != now[k]]
        if changed:
            shown = "; ".join(f"{k} ({OPTION_NAMES.get(k, k)}): {_short(before.get(k))} then, {_short(now[k])} now"
                              for k in changed)
            raise ValueError(f"{output} was mined with other settings ({shown}; see {meta}): mining on would mix "
                             "rows scored two ways; use the same settings, another --output, or --overwrite to start "
                             "over")
    elif output.exists() and output.stat().st_size:
        raise ValueError(f"{output} exists and was not written by mine-negatives (no {meta.name}); use another "
                         "--output, or --overwrite to replace it")
    elif cache.is_dir() and any(cache.glob("emb-*.npy")):
        raise ValueError(f"{cache} holds embeddings but there is no {meta.name} saying how they were made: they may "
                         f"belong to another run; delete {cache}, or pass --overwrite")


def mine_negatives(encoder, rows: QueryRows, output: str | os.PathLike, *, extra_candidates: list[str] = (),
                   candidate_files=(), lo: int = 10, hi: int = 100, negatives: int = 15,
                   margin: float | None = None, seed: int = 0, chunk_size: int = 1024, batch_size: int = 64,
                   overwrite: bool = False, show_progress_bar: bool | None = None) -> dict[str, int]:
    """Mine negatives for ``rows`` with ``encoder`` (anything with ``encode(texts, batch_size=...)`` returning
    normalised vectors) and append them to ``output`` as JSONL; see the module docstring. The candidates: the rows'
    positives and negatives, ``extra_candidates`` and the lines of ``candidate_files`` (:func:`read_candidates`).
    Returns counts: ``rows`` written now, ``skipped`` (already there), ``short`` (rows that got fewer than
    ``negatives``)."""
    check_mining_options(lo=lo, hi=hi, negatives=negatives, margin=margin, seed=seed, chunk_size=chunk_size)
    output = Path(output)
    _, meta, cache = written_paths(output)
    available = available_bytes("cpu")
    dim = embedding_dim(encoder, rows.queries[0])
    own = candidate_pool(rows, [])
    extra = [*extra_candidates, *read_candidates(candidate_files, dim=dim, available=available,
                                                 already=len(own) * (4 * dim + CANDIDATE_OVERHEAD))]
    pool = list(dict.fromkeys([*own, *extra]))
    del extra
    if lo >= len(pool):
        raise ValueError(f"--range-for-sampling {lo}-{hi} starts past the candidates: there are {len(pool)} (ranks 0 "
                         f"to {len(pool) - 1}), so no row would get a negative; use a range starting below "
                         f"{len(pool)}, or more --candidates")
    settings = MiningSettings(model=str(getattr(encoder, "base_model", type(encoder).__name__)), lo=lo, hi=hi,
                              negatives=negatives, margin=margin, seed=seed, candidates_sha256=_sha(pool),
                              queries_sha256=_sha(q + "\x1f" + "\x1f".join(p)
                                                  for q, p in zip(rows.queries, rows.positives)),
                              encoder={k: v for k, v in encoder_identity(encoder).items() if k != "model"})
    done = 0
    if not overwrite:
        _check_resume(output, settings)
        done = _done_rows(output)
        if done > len(rows):
            raise ValueError(f"{output} holds {done} rows, more than the {len(rows)} of the input: not this input's")
        if done == len(rows):
            return {"rows": 0, "skipped": done, "short": 0}
    top = min(hi, len(pool))
    check_mining_memory(len(pool), dim, chunk_size=chunk_size, queries=len(rows) - done, top=top,
                        available=available_bytes("cpu"))
    if overwrite:
        output.unlink(missing_ok=True)
        for f in cache.glob("emb-*.npy") if cache.is_dir() else ():
            f.unlink()
    write_json_atomic(meta, asdict(settings))
    index = {t: i for i, t in enumerate(pool)}
    cand = torch.from_numpy(encode_cached(encoder, pool, cache, dim=dim, batch_size=batch_size,
                                          show_progress_bar=show_progress_bar, chunk=CACHE_CHUNK))
    short = 0
    with open(output, "a", encoding="utf-8") as out:
        for start in tqdm(range(done, len(rows), chunk_size), desc="mine negatives",
                          disable=show_progress_bar is False):
            end = min(start + chunk_size, len(rows))
            q = torch.from_numpy(np.asarray(encoder.encode(rows.queries[start:end], batch_size=batch_size,
                                                           show_progress_bar=False), dtype=np.float32))
            sims = q @ cand.T  # (chunk, candidates): exact cosines of normalised vectors
            scores, ranked = sims.topk(top, dim=1)
            lines = []
            for r in range(end - start):
                i = start + r
                own_texts = {rows.queries[i], *rows.positives[i]}
                pos_sim = float(max(sims[r, index[p]] for p in rows.positives[i]))
                keep = [int(c) for c, s in zip(ranked[r, lo:].tolist(), scores[r, lo:].tolist())
                        if pool[int(c)] not in own_texts and (margin is None or s <= pos_sim - margin)]
                if len(keep) > negatives:
                    pick = np.random.default_rng([int(seed), i]).choice(len(keep), size=negatives, replace=False)
                    keep = [keep[j] for j in sorted(pick.tolist())]
                short += len(keep) < negatives
                lines.append(json.dumps({"query": rows.queries[i], "pos": list(rows.positives[i]),
                                         "neg": [pool[c] for c in keep]}, ensure_ascii=False) + "\n")
            out.write("".join(lines))  # one chunk at a time: a killed run loses at most the chunk in flight
            out.flush()
            os.fsync(out.fileno())
    return {"rows": len(rows) - done, "skipped": done, "short": short}

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

Resumable: the candidate embeddings are written chunk by chunk into ``<output>.cache/`` (one ``.npy`` per chunk,
each written atomically), the output is appended row by row (a torn last line from a killed run is dropped), and
``<output>.meta.json`` records the settings; running the same command again continues where it stopped, and other
settings (or other candidates) are refused rather than mixed in.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fastprompt.data.retrieval import QueryRows
from fastprompt.io import atomic_file, read_json, write_json_atomic

logger = logging.getLogger(__name__)


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

    def check(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"range_for_sampling must be lo-hi with 0 <= lo < hi, got {self.lo}-{self.hi}")
        if self.negatives < 1:
            raise ValueError(f"negatives must be >= 1, got {self.negatives}")


def _sha(texts) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\x1e")
    return h.hexdigest()


def model_identity(encoder) -> str:
    """The base model and a hash of the prompt's weights: the cached embeddings belong to exactly this encoder."""
    name = str(getattr(encoder, "base_model", type(encoder).__name__))
    state = getattr(encoder, "prompt_state_dict", dict)()
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode() + state[key].detach().float().cpu().numpy().tobytes())
    return f"{name} (prompt sha256 {h.hexdigest()[:16]})" if state else name


def candidate_pool(rows: QueryRows, extra: list[str]) -> list[str]:
    """The candidates: every positive and negative of the rows, then the ``extra`` texts, each once, in order."""
    pool = [t for pos, neg in zip(rows.positives, rows.negatives) for t in (*pos, *neg)]
    return list(dict.fromkeys([*pool, *extra]))


def encode_cached(encoder, texts: list[str], cache: Path, *, chunk: int, batch_size: int,
                  show_progress_bar: bool | None) -> np.ndarray:
    """(len(texts), d) float32 normalised embeddings, ``chunk`` texts per cache file (existing files are reused)."""
    cache.mkdir(parents=True, exist_ok=True)
    parts = []
    starts = range(0, len(texts), chunk)
    for n, start in enumerate(tqdm(starts, desc="encode candidates", disable=show_progress_bar is False)):
        path = cache / f"emb-{n:06d}.npy"
        want = min(chunk, len(texts) - start)
        if path.is_file():
            part = np.load(path, allow_pickle=False)
            if part.shape[0] != want:
                raise ValueError(f"{path} holds {part.shape[0]} embeddings, not {want}: the cache belongs to another "
                                 f"run; delete {cache} to start over")
        else:
            part = encoder.encode(texts[start:start + want], batch_size=batch_size, show_progress_bar=False)
            with atomic_file(path, "embedding cache") as tmp:
                with open(tmp, "wb") as fh:
                    np.save(fh, np.asarray(part, dtype=np.float32), allow_pickle=False)
        parts.append(part)
    return np.concatenate(parts)


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


def _check_meta(output: Path, settings: MiningSettings, resume: bool) -> None:
    meta = written_paths(output)[1]
    if resume and meta.is_file():
        before = read_json(meta, "mining settings")
        if before != asdict(settings):
            changed = sorted(k for k in asdict(settings) if before.get(k) != asdict(settings)[k])
            raise ValueError(f"{output} was mined with other settings ({', '.join(changed)} differ; see {meta}): "
                             "use another --output, or --overwrite to start over")
    elif resume and output.exists() and output.stat().st_size:
        raise ValueError(f"{output} exists and was not written by mine-negatives (no {meta.name}); use another "
                         "--output, or --overwrite to replace it")
    write_json_atomic(meta, asdict(settings))


def mine_negatives(encoder, rows: QueryRows, output: str | os.PathLike, *, extra_candidates: list[str] = (),
                   lo: int = 10, hi: int = 100, negatives: int = 15, margin: float | None = None, seed: int = 0,
                   chunk_size: int = 1024, batch_size: int = 64, overwrite: bool = False,
                   show_progress_bar: bool | None = None) -> dict[str, int]:
    """Mine negatives for ``rows`` with ``encoder`` (anything with ``encode(texts, batch_size=...)`` returning
    normalised vectors) and append them to ``output`` as JSONL; see the module docstring. Returns counts:
    ``rows`` written now, ``skipped`` (already there), ``short`` (rows that got fewer than ``negatives``)."""
    output = Path(output)
    pool = candidate_pool(rows, list(extra_candidates))
    settings = MiningSettings(model=model_identity(encoder), lo=lo, hi=hi,
                              negatives=negatives, margin=margin, seed=seed, candidates_sha256=_sha(pool),
                              queries_sha256=_sha(q + "\x1f" + "\x1f".join(p)
                                                  for q, p in zip(rows.queries, rows.positives)))
    settings.check()
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cache = written_paths(output)[2]
    if overwrite:
        output.unlink(missing_ok=True)
        for f in cache.glob("emb-*.npy") if cache.is_dir() else ():
            f.unlink()
    _check_meta(output, settings, resume=not overwrite)
    done = _done_rows(output)
    if done > len(rows):
        raise ValueError(f"{output} holds {done} rows, more than the {len(rows)} of the input: not this input's")
    if done == len(rows):
        return {"rows": 0, "skipped": done, "short": 0}
    index = {t: i for i, t in enumerate(pool)}
    cand = torch.from_numpy(encode_cached(encoder, pool, cache, chunk=max(chunk_size, 4096), batch_size=batch_size,
                                          show_progress_bar=show_progress_bar))
    top = min(hi, len(pool))
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
                own = {rows.queries[i], *rows.positives[i]}
                pos_sim = float(max(sims[r, index[p]] for p in rows.positives[i]))
                keep = [int(c) for c, s in zip(ranked[r, lo:].tolist(), scores[r, lo:].tolist())
                        if pool[int(c)] not in own and (margin is None or s <= pos_sim - margin)]
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

"""The STS evaluation protocol of SimCSE / DCPCSE / PromCSE, reading SentEval's on-disk layout.

Protocol: embed both sentences of every scored pair, take the cosine similarity, and report
Spearman's rank correlation with the gold scores x 100. STS12-16 use SentEval's "all" setting:
every scored pair of a year's sub-datasets concatenated into one list (not the mean over
sub-datasets). STS-B and SICK-R use their test split (STS-B dev is the model-selection set).

Loader details that change the numbers (and match SentEval's own loaders):
- STS.input lines are ``sentence1<TAB>sentence2[<TAB>source...]``: only the first two columns
  are sentences (STS16 carries two extra source columns).
- An empty line in STS.gs marks an unscored pair: it is dropped together with its input line.
- STS-B csv files are tab separated without quoting (sentences contain bare ``"``); gold score
  in column 5, sentences in columns 6 and 7 (1-based); some lines carry two extra columns.
- SICK files have a header row; columns are located by name.
- ``preprocess="senteval"`` (default) gives the sentences the papers saw: SentEval's download
  script (get_transfer_data.bash) runs every sentence through the Moses tokenizer
  (``tokenizer.perl -l en -no-escape``) and lower-cases STS12-16 and STS-B (not SICK); we apply the
  same with sacremoses to the raw SemEval / STS-B / SICK files. It moves scores by up to ~0.01
  (cased models: more). ``preprocess="none"`` scores the raw text (what MTEB's STSBenchmark and
  SICK-R use); use it too for a SentEval folder whose files the script already tokenised.
- Sentences are then whitespace-normalised like SentEval's ``" ".join(s.split())``.

Directory layout: ``<sts_dir>/STS12-en-test``, ..., ``<sts_dir>/STSBenchmark``, ``<sts_dir>/SICK``
(the layout of the bundled STS data), or SentEval's own ``data/downstream`` root, where the STS folders
live under ``STS/``.
"""
from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from fastprompt.io import read_utf8_lines
from fastprompt.messages import shown

logger = logging.getLogger(__name__)

#: The seven tasks of the papers' table, in table order.
STS_TASKS: tuple[str, ...] = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")

#: Column headers used by :func:`format_sts_table`.
TASK_TITLES: dict[str, str] = {
    "sts12": "STS12", "sts13": "STS13", "sts14": "STS14", "sts15": "STS15", "sts16": "STS16",
    "stsb": "STS-B", "sickr": "SICK-R", "avg": "Avg.",
}

# SentEval's sub-dataset lists (STS13 "SMT" is not distributed, so SentEval and we skip it).
STS_YEAR_SUBSETS: dict[str, tuple[str, tuple[str, ...]]] = {
    "sts12": ("STS12-en-test", ("MSRpar", "MSRvid", "SMTeuroparl", "surprise.OnWN", "surprise.SMTnews")),
    "sts13": ("STS13-en-test", ("FNWN", "headlines", "OnWN")),
    "sts14": ("STS14-en-test", ("deft-forum", "deft-news", "headlines", "images", "OnWN", "tweet-news")),
    "sts15": ("STS15-en-test", ("answers-forums", "answers-students", "belief", "headlines", "images")),
    "sts16": ("STS16-en-test", ("answer-answer", "headlines", "plagiarism", "postediting", "question-question")),
}
STSB_SPLITS: dict[str, str] = {"train": "sts-train.csv", "dev": "sts-dev.csv", "test": "sts-test.csv"}
SICK_SPLITS: dict[str, str] = {
    "train": "SICK_train.txt", "trial": "SICK_trial.txt", "test": "SICK_test_annotated.txt",
}
#: Sentence preprocessing choices (see the module docstring).
PREPROCESS: tuple[str, ...] = ("senteval", "none")
_ALIASES = {"sts-b": "stsb", "stsbenchmark": "stsb", "sick-r": "sickr", "sick": "sickr"}


@dataclass(frozen=True)
class STSData:
    """Scored sentence pairs of one task: ``sentences1[i]`` vs ``sentences2[i]`` with gold ``scores[i]``."""

    name: str
    sentences1: list[str]
    sentences2: list[str]
    scores: np.ndarray  # float64, shape (n,)

    def __post_init__(self):
        if not (len(self.sentences1) == len(self.sentences2) == len(self.scores)):
            raise ValueError(
                f"{self.name}: {len(self.sentences1)} first sentences, {len(self.sentences2)} second "
                f"sentences and {len(self.scores)} scores; they must be equal"
            )

    def __len__(self) -> int:
        return len(self.scores)


# ----------------------------------------------------------------------------------------- reading
def _read_lines(path: Path) -> list[str]:
    return read_utf8_lines(path, what="STS file")


def _norm(sentence: str) -> str:
    return " ".join(sentence.split())


@functools.lru_cache(maxsize=1)
def _moses_tokenizer():
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        raise ImportError(
            "preprocess='senteval' needs the Moses tokenizer port sacremoses (pip install sacremoses); "
            "or pass preprocess='none' to score the raw sentences"
        ) from None
    return MosesTokenizer(lang="en")


def senteval_tokenize(sentences: Sequence[str], *, lowercase: bool) -> list[str]:
    """What SentEval's download script does to a column of sentences: Moses-tokenise, optionally lower-case."""
    tok, seen, out = _moses_tokenizer(), {}, []
    for s in sentences:
        t = seen.get(s)
        if t is None:
            t = tok.tokenize(s, escape=False, return_str=True)
            seen[s] = t = t.lower() if lowercase else t
        out.append(t)
    return out


def _check_preprocess(preprocess: str) -> None:
    if preprocess not in PREPROCESS:
        raise ValueError(f"unknown preprocess {preprocess!r}; expected one of {PREPROCESS}")


def _finish(name: str, s1: list[str], s2: list[str], gold: list[float], preprocess: str, lowercase: bool) -> STSData:
    if preprocess == "senteval":
        s1, s2 = senteval_tokenize(s1, lowercase=lowercase), senteval_tokenize(s2, lowercase=lowercase)
    return STSData(name, [_norm(s) for s in s1], [_norm(s) for s in s2], np.asarray(gold, dtype=np.float64))


def _parse_score(text: str, path: Path, line_no: int) -> float:
    try:
        score = float(text)
    except ValueError:
        raise ValueError(f"{path}:{line_no}: gold score {shown(text)} is not a number") from None
    if not math.isfinite(score):  # nan or inf would be ranked (inf first or last) or break the correlation
        raise ValueError(f"{path}:{line_no}: gold score {shown(text)} is not a finite number")
    return score


def _task_root(sts_dir: Path, folder: str) -> Path:
    """``sts_dir/folder``, or ``sts_dir/STS/folder`` in SentEval's ``data/downstream`` layout."""
    candidates = [sts_dir / folder, sts_dir / "STS" / folder]
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError(
        f"STS folder {folder!r} not found; looked for {' and '.join(str(c) for c in candidates)}"
    )


def _check_dir(sts_dir: str | Path) -> Path:
    sts_dir = Path(sts_dir)
    if not sts_dir.is_dir():
        if sts_dir.exists():
            raise NotADirectoryError(f"STS directory {sts_dir} is a file, not a folder")
        raise FileNotFoundError(f"STS directory not found: {sts_dir}")
    return sts_dir


def load_sts_year(sts_dir: str | Path, task: str, *, preprocess: str = "senteval") -> STSData:
    """STS12-16 in SentEval's "all" setting: every scored pair of the year's sub-datasets, concatenated."""
    _check_preprocess(preprocess)
    task = canonical_task(task)
    if task not in STS_YEAR_SUBSETS:
        raise ValueError(f"{task!r} is not an STS year; expected one of {sorted(STS_YEAR_SUBSETS)}")
    folder, subsets = STS_YEAR_SUBSETS[task]
    root = _task_root(_check_dir(sts_dir), folder)
    s1, s2, gold = [], [], []
    for subset in subsets:
        inp, gs = root / f"STS.input.{subset}.txt", root / f"STS.gs.{subset}.txt"
        pairs, golds = _read_lines(inp), _read_lines(gs)
        if len(pairs) != len(golds):
            raise ValueError(f"{inp} has {len(pairs)} lines but {gs} has {len(golds)}; they must match")
        for i, (pair, g) in enumerate(zip(pairs, golds), start=1):
            g = g.strip()
            if not g:  # unscored pair: skip it with its input line
                continue
            cols = pair.split("\t")
            if len(cols) < 2:
                raise ValueError(f"{inp}:{i}: expected 'sentence1<TAB>sentence2', found no tab")
            s1.append(cols[0])
            s2.append(cols[1])
            gold.append(_parse_score(g, gs, i))
    return _finish(task, s1, s2, gold, preprocess, lowercase=True)


def load_stsb(sts_dir: str | Path, split: str = "test", *, preprocess: str = "senteval") -> STSData:
    """STS Benchmark split ``train``/``dev``/``test`` (tab separated, no quoting)."""
    _check_preprocess(preprocess)
    if split not in STSB_SPLITS:
        raise ValueError(f"unknown STS-B split {split!r}; expected one of {sorted(STSB_SPLITS)}")
    path = _task_root(_check_dir(sts_dir), "STSBenchmark") / STSB_SPLITS[split]
    s1, s2, gold = [], [], []
    for i, line in enumerate(_read_lines(path), start=1):
        cols = line.split("\t")
        if len(cols) < 7:
            raise ValueError(
                f"{path}:{i}: expected at least 7 tab-separated columns (score in 5, sentences in 6 and 7), "
                f"found {len(cols)}"
            )
        gold.append(_parse_score(cols[4].strip(), path, i))
        s1.append(cols[5])
        s2.append(cols[6])
    return _finish("stsb", s1, s2, gold, preprocess, lowercase=True)


def load_sickr(sts_dir: str | Path, split: str = "test", *, preprocess: str = "senteval") -> STSData:
    """SICK relatedness split ``train``/``trial``/``test``, or ``all`` (the three concatenated, as MTEB's SICK-R)."""
    _check_preprocess(preprocess)
    if split == "all":
        parts = [load_sickr(sts_dir, s, preprocess=preprocess) for s in ("train", "trial", "test")]
        return STSData(
            "sickr",
            [s for p in parts for s in p.sentences1],
            [s for p in parts for s in p.sentences2],
            np.concatenate([p.scores for p in parts]),
        )
    if split not in SICK_SPLITS:
        raise ValueError(f"unknown SICK split {split!r}; expected one of {sorted(SICK_SPLITS)} or 'all'")
    path = _task_root(_check_dir(sts_dir), "SICK") / SICK_SPLITS[split]
    lines = _read_lines(path)
    header = lines[0].split("\t") if lines else []
    try:
        ia, ib, isc = (header.index(c) for c in ("sentence_A", "sentence_B", "relatedness_score"))
    except ValueError:
        raise ValueError(
            f"{path}: header row must name the columns sentence_A, sentence_B and relatedness_score; "
            f"found {header!r}"
        ) from None
    s1, s2, gold = [], [], []
    for i, line in enumerate(lines[1:], start=2):
        cols = line.split("\t")
        if len(cols) < len(header):
            raise ValueError(f"{path}:{i}: expected {len(header)} tab-separated columns, found {len(cols)}")
        s1.append(cols[ia])
        s2.append(cols[ib])
        gold.append(_parse_score(cols[isc].strip(), path, i))
    return _finish("sickr", s1, s2, gold, preprocess, lowercase=False)  # SentEval does not lower-case SICK


def canonical_task(name: str) -> str:
    """Lower-case task name with aliases resolved (``STS-B`` -> ``stsb``); ValueError for unknown ones."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in STS_TASKS:
        raise ValueError(f"unknown STS task {name!r}; expected one of {', '.join(STS_TASKS)}")
    return key


def parse_tasks(tasks: str | Iterable[str] | None) -> list[str]:
    """Task list from ``"sts12,stsb"`` or an iterable; ``None`` means all seven. Duplicates are an error."""
    if tasks is None:
        return list(STS_TASKS)
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t.strip()]
    out = [canonical_task(t) for t in tasks]
    if not out:
        raise ValueError("no STS task given")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate STS task in {out}")
    return out


def load_sts_task(
    sts_dir: str | Path, task: str, *, stsb_split: str = "test", sickr_split: str = "test", preprocess: str = "senteval"
) -> STSData:
    """One task by name (see :data:`STS_TASKS`)."""
    task = canonical_task(task)
    if task == "stsb":
        return load_stsb(sts_dir, stsb_split, preprocess=preprocess)
    if task == "sickr":
        return load_sickr(sts_dir, sickr_split, preprocess=preprocess)
    return load_sts_year(sts_dir, task, preprocess=preprocess)


def load_sts_tasks(
    sts_dir: str | Path,
    tasks: str | Iterable[str] | None = None,
    *,
    stsb_split: str = "test",
    sickr_split: str = "test",
    preprocess: str = "senteval",
) -> dict[str, STSData]:
    """Several tasks (default: all seven), in the order given."""
    return {
        t: load_sts_task(sts_dir, t, stsb_split=stsb_split, sickr_split=sickr_split, preprocess=preprocess)
        for t in parse_tasks(tasks)
    }


# -------------------------------------------------------------------------------------- protocol
def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x)


def encode_sentences(model, sentences: Sequence[str], *, batch_size: int = 64,
                     show_progress_bar: bool | None = None) -> np.ndarray:
    """``model.encode`` on a list of sentences, checked to return one finite vector per sentence."""
    if len(sentences) == 0:
        raise ValueError("no sentences to encode")
    emb = _to_numpy(model.encode(list(sentences), batch_size=batch_size, show_progress_bar=show_progress_bar))
    if emb.ndim != 2 or emb.shape[0] != len(sentences):
        raise ValueError(
            f"model.encode returned shape {emb.shape} for {len(sentences)} sentences; expected ({len(sentences)}, dim)"
        )
    if not np.isfinite(emb).all():
        raise ValueError("model.encode returned NaN or infinite values")
    return emb


def cosine_similarity_pairs(emb1: np.ndarray, emb2: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity, computed in float64 (zero vectors get similarity 0)."""
    a, b = np.asarray(emb1, dtype=np.float64), np.asarray(emb2, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"embeddings must be two (n, dim) arrays of the same shape, got {a.shape} and {b.shape}")
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    return np.einsum("ij,ij->i", a, b) / np.maximum(na * nb, np.finfo(np.float64).tiny)


def spearman_x100(predicted: np.ndarray, gold: np.ndarray) -> float:
    """Spearman's rho x 100 (scipy.stats.spearmanr, average ranks for ties)."""
    predicted, gold = np.asarray(predicted, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if predicted.shape != gold.shape or predicted.ndim != 1:
        raise ValueError(f"need two 1-D arrays of equal length, got {predicted.shape} and {gold.shape}")
    if len(gold) < 2:
        raise ValueError("Spearman correlation needs at least two pairs")
    for name, values in (("predicted", predicted), ("gold", gold)):
        bad = int(np.count_nonzero(~np.isfinite(values)))
        if bad:
            raise ValueError(f"Spearman correlation is undefined: {bad} of the {len(values)} {name} scores are NaN or "
                             "infinite")
    with warnings.catch_warnings():  # a constant input gets our ValueError below, not a warning
        warnings.simplefilter("ignore")
        rho = spearmanr(predicted, gold).statistic
    if not np.isfinite(rho):
        raise ValueError("Spearman correlation is undefined: the predicted or gold scores are constant")
    return float(rho) * 100.0


def encode_pairs(
    model,
    datasets: Mapping[str, STSData],
    *,
    batch_size: int = 64,
    show_progress_bar: bool | None = None,
    known: Mapping[str, np.ndarray] | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Embeddings of both sides of every task's pairs.

    Every distinct sentence over all tasks is encoded once (STS13-16 and STS-B share headlines,
    SICK repeats sentences across pairs): about 25% fewer sentences for the seven-task table.
    ``known``: vectors this same model already gave (sentence -> vector, e.g. :func:`sentence_vectors` of an
    earlier evaluation of the same weights); only the other sentences are encoded. Batches then hold other
    sentences, so a reused vector may differ from a fresh one in the last float32 bits (padding changes the
    shapes the kernels run on), far below the table's two decimals.
    """
    index: dict[str, int] = {}
    for data in datasets.values():
        for s in (*data.sentences1, *data.sentences2):
            index.setdefault(s, len(index))
    todo = [s for s in index if s not in known] if known else list(index)
    if len(todo) == len(index):
        emb = encode_sentences(model, todo, batch_size=batch_size, show_progress_bar=show_progress_bar)
    else:
        fresh = (dict(zip(todo, encode_sentences(model, todo, batch_size=batch_size,
                                                 show_progress_bar=show_progress_bar))) if todo else {})
        emb = np.stack([fresh[s] if s in fresh else known[s] for s in index])
        logger.info("encoded %d sentences, reused %d encoded before", len(todo), len(index) - len(todo))
    out = {}
    for name, data in datasets.items():
        i1 = np.fromiter((index[s] for s in data.sentences1), dtype=np.int64, count=len(data))
        i2 = np.fromiter((index[s] for s in data.sentences2), dtype=np.int64, count=len(data))
        out[name] = (emb[i1], emb[i2])
    return out


def sentence_vectors(
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], datasets: Mapping[str, STSData]
) -> dict[str, np.ndarray]:
    """The table sentence -> vector of :func:`encode_pairs`' output (for its ``known`` argument)."""
    out: dict[str, np.ndarray] = {}
    for name, (e1, e2) in pairs.items():
        data = datasets[name]
        out.update(zip(data.sentences1, e1))
        out.update(zip(data.sentences2, e2))
    return out


def score_sts(
    model,
    datasets: Mapping[str, STSData],
    *,
    batch_size: int = 64,
    show_progress_bar: bool | None = None,
) -> dict[str, float]:
    """Spearman x 100 of each loaded task, plus ``"avg"`` (their unrounded mean) when there are several."""
    if not datasets:
        raise ValueError("no STS task to score")
    pairs = encode_pairs(model, datasets, batch_size=batch_size, show_progress_bar=show_progress_bar)
    return scores_from_pairs(pairs, datasets)


def scores_from_pairs(
    pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], datasets: Mapping[str, STSData]
) -> dict[str, float]:
    """:func:`score_sts` on embeddings from :func:`encode_pairs` (to reuse them, e.g. for geometry metrics)."""
    results = {}
    for name, (e1, e2) in pairs.items():
        results[name] = spearman_x100(cosine_similarity_pairs(e1, e2), datasets[name].scores)
        logger.info("%s: %.2f (%d pairs)", name, results[name], len(datasets[name]))
    if len(results) > 1:
        results["avg"] = float(np.mean(list(results.values())))
    return results


def evaluate_sts(
    model,
    sts_dir: str | Path,
    tasks: str | Iterable[str] | None = None,
    *,
    stsb_split: str = "test",
    sickr_split: str = "test",
    preprocess: str = "senteval",
    batch_size: int = 64,
    show_progress_bar: bool | None = None,
) -> dict[str, float]:
    """Evaluate ``model`` on STS tasks read from ``sts_dir`` (SentEval layout).

    ``model`` is anything with ``encode(sentences, batch_size=..., show_progress_bar=...)``
    returning an ``(n, dim)`` array or tensor: a :class:`fastprompt.PromptEncoder`, a
    sentence-transformers model, ... Returns ``{"sts12": 72.37, ..., "avg": ...}`` (Spearman x 100,
    unrounded), tasks in the order given; ``"avg"`` only when several tasks are scored.
    ``stsb_split="dev"`` gives the model-selection score; ``preprocess`` is ``"senteval"`` (the
    papers' Moses-tokenised sentences) or ``"none"`` (raw text).
    """
    datasets = load_sts_tasks(sts_dir, tasks, stsb_split=stsb_split, sickr_split=sickr_split, preprocess=preprocess)
    return score_sts(model, datasets, batch_size=batch_size, show_progress_bar=show_progress_bar)


def scores_at_dims(pairs: Mapping[str, tuple[np.ndarray, np.ndarray]], datasets: Mapping[str, STSData],
                   dims: Sequence[int]) -> dict[int, dict[str, float]]:
    """:func:`scores_from_pairs` of each Matryoshka dimension: the cosines of the first ``d`` coordinates of each
    embedding (re-normalised, which the cosine does: what ``encode(..., dim=d)`` gives), from one encoding."""
    width = next(iter(pairs.values()))[0].shape[1]
    bad = [d for d in dims if not 1 <= d <= width]
    if bad:
        raise ValueError(f"Matryoshka dimensions {bad} are outside 1..{width}, the embeddings' size")
    return {int(d): scores_from_pairs({k: (e1[:, :d], e2[:, :d]) for k, (e1, e2) in pairs.items()}, datasets)
            for d in dims}


def evaluate_sts_dims(model, sts_dir: str | Path, dims: Sequence[int], tasks: str | Iterable[str] | None = None, *,
                      batch_size: int = 64, show_progress_bar: bool | None = None,
                      **load_options) -> dict[int, dict[str, float]]:
    """:func:`evaluate_sts` at each of ``dims`` (Matryoshka dimensions), encoding every sentence once:
    ``{384: {"sts12": ..., "avg": ...}, 128: {...}}``."""
    datasets = load_sts_tasks(sts_dir, tasks, **load_options)
    pairs = encode_pairs(model, datasets, batch_size=batch_size, show_progress_bar=show_progress_bar)
    return scores_at_dims(pairs, datasets, dims)


def format_sts_table(results: Mapping[str, float], titles: Mapping[str, str] | None = None) -> str:
    """SimCSE-style table: one column per task (in the given order), scores with two decimals.

    ``titles`` maps result keys to column headers (default :data:`TASK_TITLES`; unknown keys as is).
    """
    if not results:
        raise ValueError("no results to format")
    titles = TASK_TITLES if titles is None else titles
    titles = [titles.get(k, k) for k in results]
    cells = [f"{v:.2f}" for v in results.values()]
    widths = [max(len(t), len(c)) for t, c in zip(titles, cells)]
    rule = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def row(items):
        return "|" + "|".join(f" {x:>{w}} " for x, w in zip(items, widths)) + "|"

    return "\n".join([rule, row(titles), rule, row(cells), rule])

"""fastprompt mine-negatives: exact top-k against a brute-force reference, range for sampling, margin filter,
resume, and the JSONL that training reads."""
import json

import numpy as np
import pytest

from fastprompt import cli
from fastprompt.data import load_train_file
from fastprompt.data.mining import mine_negatives
from fastprompt.data.retrieval import QueryRows
from fastprompt.data.train_files import load_query_rows


class VectorEncoder:
    """An encoder whose embeddings are fixed random unit vectors per text (the reference needs no model)."""

    def __init__(self, dim=8):
        self.dim, self.calls = dim, 0

    def vec(self, text):
        rng = np.random.default_rng(abs(hash(text)) % (2**32))
        v = rng.standard_normal(self.dim).astype(np.float32)
        return v / np.linalg.norm(v)

    def encode(self, texts, batch_size=64, show_progress_bar=None):
        self.calls += len(texts)
        return np.stack([self.vec(t) for t in texts])


def _rows(n=12, extra=40):
    queries = [f"query {i}" for i in range(n)]
    return QueryRows(queries, [(f"pos {i}",) for i in range(n)], [() for _ in range(n)]), \
        [f"doc {j}" for j in range(extra)]


def _read(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_mined_negatives_are_the_exact_ranks_in_range_minus_own_texts_and_margin(tmp_path):
    rows, extra = _rows()
    enc = VectorEncoder()
    out = tmp_path / "mined.jsonl"
    counts = mine_negatives(enc, rows, out, extra_candidates=extra, lo=2, hi=20, negatives=5, margin=0.05, seed=1,
                            chunk_size=5, show_progress_bar=False)
    assert counts == {"rows": 12, "skipped": 0, "short": counts["short"]}
    pool = [f"pos {i}" for i in range(12)] + extra
    emb = np.stack([enc.vec(t) for t in pool])
    for i, row in enumerate(_read(out)):
        assert row["query"] == f"query {i}" and row["pos"] == [f"pos {i}"]
        sims = emb @ enc.vec(row["query"])
        order = np.argsort(-sims, kind="stable")[2:20]  # the brute-force ranks of the sampling range
        pos_sim = sims[pool.index(f"pos {i}")]
        allowed = {pool[c] for c in order if pool[c] != f"pos {i}" and sims[c] <= pos_sim - 0.05}
        assert set(row["neg"]) <= allowed and len(row["neg"]) == min(5, len(allowed))
    # the draw is seeded: the same command gives the same file; another seed another one
    again = tmp_path / "again.jsonl"
    mine_negatives(VectorEncoder(), rows, again, extra_candidates=extra, lo=2, hi=20, negatives=5, margin=0.05,
                   seed=1, chunk_size=7, show_progress_bar=False)
    assert again.read_text() == out.read_text()


def test_resume_continues_and_other_settings_are_refused(tmp_path):
    rows, extra = _rows(n=10)
    out = tmp_path / "mined.jsonl"
    full = tmp_path / "full.jsonl"
    mine_negatives(VectorEncoder(), rows, full, extra_candidates=extra, lo=0, hi=10, negatives=3, chunk_size=4,
                   show_progress_bar=False)
    mine_negatives(VectorEncoder(), rows, out, extra_candidates=extra, lo=0, hi=10, negatives=3, chunk_size=4,
                   show_progress_bar=False)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:6]) + lines[6][:10])  # killed mid-line after 6 rows
    enc = VectorEncoder()
    counts = mine_negatives(enc, rows, out, extra_candidates=extra, lo=0, hi=10, negatives=3, chunk_size=4,
                            show_progress_bar=False)
    assert counts["skipped"] == 6 and counts["rows"] == 4
    assert enc.calls == 4  # the candidates came from the cache: only the 4 remaining queries were encoded
    assert out.read_text() == full.read_text()
    with pytest.raises(ValueError, match="other settings \\(negatives differ"):
        mine_negatives(VectorEncoder(), rows, out, extra_candidates=extra, lo=0, hi=10, negatives=4,
                       show_progress_bar=False)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"query": "mine"}\n')
    with pytest.raises(ValueError, match="not written by mine-negatives"):
        mine_negatives(VectorEncoder(), rows, foreign, show_progress_bar=False)


def test_pairs_csv_is_mined_into_rows_training_reads(tmp_path, tiny_bert_dir):
    """The command line on sent0,sent1,hard_neg rows and a candidate corpus with the tiny BERT: JSONL whose rows
    load as query, positive and k negatives."""
    words = "man woman dog cat plays runs eating guitar ball park street car red blue big small".split()
    rng = np.random.default_rng(0)
    sents = list(dict.fromkeys(" ".join(rng.choice(words, 5)) for _ in range(80)))
    src = tmp_path / "triplets.csv"
    src.write_text("sent0,sent1,hard_neg\n" + "".join(f"{sents[i]},{sents[i + 1]},{sents[i + 2]}\n"
                                                      for i in range(0, 30, 3)), encoding="utf-8")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sents[30:]) + "\n", encoding="utf-8")
    out = tmp_path / "mined.jsonl"
    argv = ["mine-negatives", "--model", str(tiny_bert_dir), "--input", str(src), "--candidates", str(corpus),
            "--output", str(out), "--range-for-sampling", "1-20", "--negatives", "3", "--no-progress",
            "--device", "cpu"]
    assert cli.main(argv) == 0
    rows = _read(out)
    assert len(rows) == 10 and all(len(r["neg"]) == 3 for r in rows)
    assert load_query_rows(src).negatives[0] == (sents[2],)  # the input's hard negatives are candidates too
    ex = load_train_file(out)
    assert ex.columns == ("sent0", "sent1", "hard_neg", "hard_neg_2", "hard_neg_3")
    assert cli.main(argv) == 0  # again: nothing left to do
    assert len(_read(out)) == 10
    assert cli.main([*argv, "--overwrite"]) == 0 and len(_read(out)) == 10
    with pytest.raises(SystemExit):
        cli.main([*argv, "--range-for-sampling", "5-2"])
    assert cli.main(["mine-negatives", "--model", str(tiny_bert_dir), "--input", str(corpus), "--output",
                     str(tmp_path / "x.jsonl"), "--no-progress"]) == 2  # sentences alone have no positives


@pytest.mark.parametrize("side", [".meta.json", ".cache/emb-000000.npy"])
@pytest.mark.parametrize("as_candidates", [False, True], ids=["input", "candidates"])
def test_an_input_that_is_a_file_mining_writes_is_refused_and_kept(tmp_path, tiny_bert_dir, capsys, side,
                                                                   as_candidates):
    """A settings file or cached embedding of --output given back as --input or --candidates, with --overwrite:
    refused before anything is read or written (the settings JSON used to replace the input), every byte kept."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"query": "q", "pos": ["p"], "neg": []}\n', encoding="utf-8")
    (tmp_path / "out.jsonl.meta.json").write_text('{"model": "m"}\n', encoding="utf-8")
    (tmp_path / "out.jsonl.cache").mkdir()
    np.save(tmp_path / "out.jsonl.cache" / "emb-000000.npy", np.zeros((1, 8), np.float32))
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\na,b\nc,d\n", encoding="utf-8")
    victim = tmp_path / f"out.jsonl{side}"
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    inputs = ["--input", str(pairs), "--candidates", str(victim)] if as_candidates else ["--input", str(victim)]
    assert cli.main(["mine-negatives", "--model", str(tiny_bert_dir), *inputs, "--output", str(out), "--overwrite",
                     "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert str(victim) in err and "choose another --output" in err
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == files
    assert {p: p.read_bytes() for p in files} == before

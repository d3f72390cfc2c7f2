"""fastprompt mine-negatives: exact top-k against a brute-force reference, range for sampling, margin filter,
resume, and the JSONL that training reads."""
import json
import re

import numpy as np
import pytest
import torch

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
    assert enc.calls == 1 + 4  # the candidates came from the cache: one text to learn the vectors' width, then the
    # 4 remaining queries were encoded
    assert out.read_text() == full.read_text()
    with pytest.raises(ValueError, match=r"other settings \(negatives \(--negatives\): 3 then, 4 now"):
        mine_negatives(VectorEncoder(), rows, out, extra_candidates=extra, lo=0, hi=10, negatives=4,
                       show_progress_bar=False)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"query": "mine"}\n')
    with pytest.raises(ValueError, match="not written by mine-negatives"):
        mine_negatives(VectorEncoder(), rows, foreign, lo=0, hi=10, show_progress_bar=False)


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


def _written(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))


def test_a_chunk_too_large_for_memory_is_refused_before_encoding_with_one_that_fits(tmp_path, monkeypatch):
    """Issue 40 item 2: 40k queries x 80k candidates with --chunk-size 40000 allocated a 12.8 GB similarity block and
    died with a RuntimeError. The estimate (candidate embeddings + one chunk's similarities and top-k) is checked
    against the memory available (patched small here: nothing big is allocated) before anything is encoded or
    written, and the message names the estimate and a --chunk-size that fits, which then runs."""
    rows, extra = _rows(n=12, extra=40)  # 52 candidates, 8 dimensions
    monkeypatch.setattr("fastprompt.data.mining.available_bytes", lambda device="cpu": 10_000)
    enc = VectorEncoder()
    with pytest.raises(ValueError, match=r"--chunk-size 12 x 52 candidates needs about .* more than the .* "
                                         r"available; use --chunk-size 2$"):
        mine_negatives(enc, rows, tmp_path / "out.jsonl", extra_candidates=extra, lo=0, hi=20, negatives=3,
                       chunk_size=12, show_progress_bar=False)
    assert enc.calls == 1 and _written(tmp_path) == []  # one text to learn the width; no file
    counts = mine_negatives(enc, rows, tmp_path / "out.jsonl", extra_candidates=extra, lo=0, hi=20, negatives=3,
                            chunk_size=2, show_progress_bar=False)
    assert counts["rows"] == 12
    monkeypatch.setattr("fastprompt.data.mining.available_bytes", lambda device="cpu": 5_000)
    with pytest.raises(ValueError, match=r"the embeddings of the 52 candidates \(8 dimensions\) need about .* mine "
                                         "against fewer candidates"):
        mine_negatives(enc, rows, tmp_path / "out2.jsonl", extra_candidates=extra, lo=0, hi=20, chunk_size=1,
                       show_progress_bar=False)


def test_candidates_are_streamed_a_bounded_line_at_a_time_and_bounded_by_memory(tmp_path, tiny_bert_dir, capsys,
                                                                                monkeypatch):
    """Issue 40 item 3: a 1.5 GB --candidates file ended in a MemoryError, and a binary one was read whole before its
    NUL byte was found. Lines are read with a bounded readline (a line of zeros is found binary after 1 MiB of it,
    not after all of it), and reading stops with a clear line once the candidates' texts and embeddings would
    outgrow the memory available (patched small here)."""
    import tracemalloc

    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\na man plays,a man plays guitar\na dog runs,a big dog runs\n", encoding="utf-8")
    base = ["mine-negatives", "--model", str(tiny_bert_dir), "--input", str(pairs), "--output",
            str(tmp_path / "out.jsonl"), "--range-for-sampling", "0-5", "--no-progress", "--device", "cpu"]
    zeros = tmp_path / "zeros.bin"
    zeros.write_bytes(b"a sentence\n" + b"\0" * (24 << 20))  # line 2: 24 MiB of zeros without a line break
    tracemalloc.start()
    try:
        assert cli.main([*base, "--candidates", str(zeros)]) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"{zeros}: a binary file, not UTF-8 text (a NUL byte on line 2)" in capsys.readouterr().err
    assert peak < 12 << 20, peak  # the 24 MiB line was never held whole
    long = tmp_path / "long.txt"
    long.write_bytes(b"a sentence\n" + b"x" * ((1 << 20) + 1) + b"\n")
    assert cli.main([*base, "--candidates", str(long)]) == 2
    assert f"{long}:2: a line longer than 1048576 bytes" in capsys.readouterr().err
    many = tmp_path / "many.txt"
    many.write_text("".join(f"candidate sentence {i}\n" for i in range(5000)), encoding="utf-8")
    # 32-dimensional vectors: ~400 bytes a candidate; 200 kB hold about 500
    monkeypatch.setattr("fastprompt.data.mining.available_bytes", lambda device="cpu": 200_000)
    assert cli.main([*base, "--candidates", str(many)]) == 2
    err = capsys.readouterr().err
    assert f"{many}:" in err and "too many candidates for this machine's memory" in err
    assert "32-dimensional embedding" in err and "mine against fewer candidates (at most about" in err
    assert _written(tmp_path) == []


def test_a_resume_with_other_vector_settings_or_changed_weights_is_refused(tmp_path, tiny_bert_dir):
    """Issue 40 item 4: resuming with another pooler or max length appended rows scored another way, a finished
    output was returned unchanged under other settings, and so after the weights changed in place. Every setting that
    decides a vector and a hash of all the weights are recorded; a resume that differs is refused, naming it."""
    from fastprompt.model import PromptEncoder

    rows, extra = _rows(n=10, extra=20)
    out = tmp_path / "out.jsonl"

    def mine(**kwargs):
        enc = PromptEncoder.from_pretrained(str(tiny_bert_dir), **{"pooler": "mean", **kwargs})
        return mine_negatives(enc, rows, out, extra_candidates=extra, lo=0, hi=10, negatives=3, chunk_size=4,
                              show_progress_bar=False), enc

    mine()
    full = out.read_bytes()
    out.write_bytes(b"".join(full.splitlines(keepends=True)[:4]))  # killed after 4 rows
    with pytest.raises(ValueError, match=r"other settings \(pooler \(--pooler\): \"mean\" then, \"cls\" now; see "):
        mine(pooler="cls")
    with pytest.raises(ValueError, match=r"other settings \(max_length \(--max-length\): 64 then, 8 now; see "):
        mine(max_length=8)
    assert mine()[0] == {"rows": 6, "skipped": 4, "short": 0} and out.read_bytes() == full  # the same: continues
    with pytest.raises(ValueError, match=r"template \(--template\): not recorded then"):
        mine(template='This sentence : "[X]" means [MASK] .')  # a finished output is not "done" under other settings
    enc = PromptEncoder.from_pretrained(str(tiny_bert_dir), pooler="mean")
    with torch.no_grad():
        enc.backbone.encoder.layer[1].output.dense.weight[0, 0] += 1e-3  # the weights change in place
    with pytest.raises(ValueError, match=r"other settings \(weights_sha256 \(the model's weights\): \w{12}\.\.\. then"):
        mine_negatives(enc, rows, out, extra_candidates=extra, lo=0, hi=10, negatives=3, show_progress_bar=False)
    assert out.read_bytes() == full


def test_another_chunk_size_on_resume_continues_the_same_file(tmp_path, monkeypatch):
    """Issue 40 item 13: the cache was chunked by max(--chunk-size, 4096) texts, so a resume with another --chunk-size
    said "the cache belongs to another run; delete it". The cache's chunk is fixed now; --chunk-size decides neither
    a vector nor a draw, and the resumed file is byte-identical to an uninterrupted run."""
    monkeypatch.setattr("fastprompt.data.mining.CACHE_CHUNK", 1000)
    rows, extra = _rows(n=10, extra=4200)
    full, out = tmp_path / "full.jsonl", tmp_path / "out.jsonl"
    for path in (full, out):
        mine_negatives(VectorEncoder(), rows, path, extra_candidates=extra, lo=0, hi=10, negatives=3, chunk_size=5000,
                       show_progress_bar=False)
    out.write_bytes(b"".join(out.read_bytes().splitlines(keepends=True)[:6]))
    counts = mine_negatives(VectorEncoder(), rows, out, extra_candidates=extra, lo=0, hi=10, negatives=3,
                            chunk_size=3, show_progress_bar=False)
    assert counts == {"rows": 4, "skipped": 6, "short": 0} and out.read_bytes() == full.read_bytes()
    stale = tmp_path / "stale.jsonl"  # a cache left without its settings file: whose is it?
    (tmp_path / "stale.jsonl.cache").mkdir()
    np.save(tmp_path / "stale.jsonl.cache" / "emb-000000.npy", np.zeros((1000, 8), np.float32))
    with pytest.raises(ValueError, match="holds embeddings but there is no stale.jsonl.meta.json"):
        mine_negatives(VectorEncoder(), rows, stale, extra_candidates=extra, lo=0, hi=10, show_progress_bar=False)


@pytest.mark.parametrize("option, value, message", [
    ("--margin", "nan", "argument --margin: expected a finite number in [-2, 2]"),
    ("--margin", "inf", "argument --margin: expected a finite number in [-2, 2]"),
    ("--margin", "3", "argument --margin: expected a finite number in [-2, 2]"),
    ("--seed", "-1", "argument --seed: expected an integer in [0, 4294967295], got '-1'"),
    ("--seed", "99999999999", "argument --seed: expected an integer in [0, 4294967295]"),
    ("--negatives", "5000", "argument --negatives: expected at most 1024"),
])
def test_options_no_run_can_use_are_refused_before_anything_is_read_or_written(tmp_path, capsys, option, value,
                                                                               message):
    """Issue 40 items 5 and 13: --margin nan gave every row zero negatives (and the next run was refused over the
    NaN in the settings file); --seed -1 was refused only after every candidate was encoded, leaving an output, its
    settings and its cache, without naming --seed."""
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\na,b\nc,d\n", encoding="utf-8")
    with pytest.raises(SystemExit) as info:
        cli.main(["mine-negatives", "--model", "no-such-model", "--input", str(pairs), "--output",
                  str(tmp_path / "out.jsonl"), option, value])
    assert info.value.code == 2 and message in capsys.readouterr().err
    assert _written(tmp_path) == []
    rows, extra = _rows()
    for bad in ({"margin": float("nan")}, {"margin": float("inf")}, {"seed": -1}, {"negatives": 5000}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mine_negatives(VectorEncoder(), rows, tmp_path / "out.jsonl", extra_candidates=extra, **bad)
    assert _written(tmp_path) == []


def test_a_range_past_the_pool_and_a_candidates_file_that_is_not_utf8_are_named(tmp_path, tiny_bert_dir, capsys):
    """Issue 40 item 13: --range-for-sampling 500-600 on a small pool said only "N with fewer than 3"; a latin-1
    --candidates file suggested on_decode_error=skip, which mine-negatives does not have."""
    rows, extra = _rows(n=12, extra=40)
    with pytest.raises(ValueError, match=r"--range-for-sampling 500-600 starts past the candidates: there are 52 "
                                         r"\(ranks 0 to 51\)"):
        mine_negatives(VectorEncoder(), rows, tmp_path / "out.jsonl", extra_candidates=extra, lo=500, hi=600)
    assert _written(tmp_path) == []
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\na man plays,a man plays guitar\na dog runs,a big dog runs\n", encoding="utf-8")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("a sentence\ncaf\u00e9 au lait\n".encode("latin-1"))
    assert cli.main(["mine-negatives", "--model", str(tiny_bert_dir), "--input", str(pairs), "--candidates",
                     str(latin), "--output", str(tmp_path / "out.jsonl"), "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{latin}:2: not valid UTF-8 (byte 3 of the line: invalid continuation byte); re-encode the file" in err
    assert "on_decode_error" not in err and _written(tmp_path) == []


def test_an_encoder_decoder_model_is_refused_when_it_loads(tmp_path, tiny_bert_dir, capsys):
    """Issue 40 item 13: a T5 model (mine-negatives or train) failed inside transformers with "You must specify
    exactly one of input_ids or inputs_embeds", after mining had written its settings and cache."""
    from transformers import AutoModel, AutoTokenizer, T5Config

    from fastprompt.model import PromptEncoder

    t5 = tmp_path / "t5"
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(t5)
    torch.manual_seed(0)
    AutoModel.from_config(T5Config(vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4,
                                   decoder_start_token_id=0)).save_pretrained(t5)
    message = "T5Model (model_type 't5') is an encoder-decoder model, which fastprompt does not support"
    with pytest.raises(ValueError, match=re.escape(message)):
        PromptEncoder.from_pretrained(str(t5), pooler="mean")  # what train builds
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\na,b\nc,d\n", encoding="utf-8")
    assert cli.main(["mine-negatives", "--model", str(t5), "--input", str(pairs), "--output",
                     str(tmp_path / "out.jsonl"), "--no-progress", "--pooler", "mean"]) == 2
    assert message in capsys.readouterr().err and _written(tmp_path) == []

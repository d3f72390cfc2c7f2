"""The STS protocol: cosine + Spearman x 100, one encode pass over unique sentences, the table."""
import zlib

import numpy as np
import pytest
import torch

from fastprompt.eval.sts import (
    STSData,
    cosine_similarity_pairs,
    encode_pairs,
    evaluate_sts,
    format_sts_table,
    load_sts_tasks,
    score_sts,
    sentence_vectors,
    spearman_x100,
)

from .test_sts_loaders import write_all, write_stsb, write_year


class HashEncoder:
    """Deterministic bag-of-words vectors (each word -> a fixed random vector); records every call."""

    def __init__(self, dim=16, as_tensor=False):
        self.dim, self.as_tensor, self.calls = dim, as_tensor, []

    def vector(self, sentence):
        out = np.zeros(self.dim)
        for w in sentence.split():
            out += np.random.default_rng(zlib.crc32(w.encode())).standard_normal(self.dim)
        return out

    def encode(self, sentences, batch_size=64, normalize=True, show_progress_bar=None):
        self.calls.append((list(sentences), batch_size, show_progress_bar))
        emb = np.stack([self.vector(s) for s in sentences]).astype(np.float32)
        return torch.from_numpy(emb) if self.as_tensor else emb


def ranks(x):
    """Average ranks with ties, written independently of scipy."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tie = x == v
        r[tie] = r[tie].mean()
    return r


def spearman_reference(a, b):
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1] * 100)


def reference_score(encoder, data: STSData):
    e1 = np.stack([encoder.vector(s) for s in data.sentences1])
    e2 = np.stack([encoder.vector(s) for s in data.sentences2])
    cos = [a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) for a, b in zip(e1, e2)]
    return spearman_reference(cos, data.scores)


def test_cosine_similarity_pairs():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((7, 5)), rng.standard_normal((7, 5))
    expected = [x @ y / np.linalg.norm(x) / np.linalg.norm(y) for x, y in zip(a, b)]
    np.testing.assert_allclose(cosine_similarity_pairs(a, b), expected, rtol=1e-12)
    np.testing.assert_allclose(cosine_similarity_pairs(a, 3 * a), np.ones(7), rtol=1e-12)
    z = np.zeros((1, 5))
    assert cosine_similarity_pairs(z, b[:1])[0] == 0.0
    with pytest.raises(ValueError, match="same shape"):
        cosine_similarity_pairs(a, b[:3])


def test_spearman_x100_with_ties():
    rng = np.random.default_rng(1)
    gold = rng.integers(0, 6, size=50).astype(float)  # heavy ties, like STS gold scores
    pred = gold + rng.standard_normal(50)
    pred[:5] = pred[5]  # ties in the predictions too
    assert spearman_x100(pred, gold) == pytest.approx(spearman_reference(pred, gold), abs=1e-10)
    assert spearman_x100([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(100.0)
    assert spearman_x100([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-100.0)
    with pytest.raises(ValueError, match="constant"):
        spearman_x100([1, 1, 1], [1, 2, 3])
    with pytest.raises(ValueError, match="at least two"):
        spearman_x100([1.0], [2.0])
    with pytest.raises(ValueError, match="equal length"):
        spearman_x100([1, 2, 3], [1, 2])


def test_encode_pairs_encodes_each_unique_sentence_once():
    datasets = {
        "a": STSData("a", ["x y", "p q", "x y"], ["p q", "z", "w"], np.array([1.0, 2.0, 3.0])),
        "b": STSData("b", ["z", "new one"], ["x y", "x y"], np.array([0.0, 5.0])),
    }
    enc = HashEncoder()
    out = encode_pairs(enc, datasets, batch_size=7, show_progress_bar=False)
    assert len(enc.calls) == 1
    sent, batch_size, bar = enc.calls[0]
    assert sorted(sent) == sorted({"x y", "p q", "z", "w", "new one"}) and len(sent) == 5
    assert (batch_size, bar) == (7, False)
    for name, data in datasets.items():
        e1, e2 = out[name]
        np.testing.assert_allclose(e1, [enc.vector(s) for s in data.sentences1], rtol=1e-6)
        np.testing.assert_allclose(e2, [enc.vector(s) for s in data.sentences2], rtol=1e-6)


def test_encode_pairs_reuses_known_vectors_and_encodes_only_the_rest():
    """``known`` (a training run's dev vectors): only the other sentences reach ``encode``, in one call; the known
    vectors land in their pairs as given; everything known means no call at all."""
    datasets = {
        "a": STSData("a", ["x y", "p q", "x y"], ["p q", "z", "w"], np.array([1.0, 2.0, 3.0])),
        "b": STSData("b", ["z", "new one"], ["x y", "x y"], np.array([0.0, 5.0])),
    }
    enc = HashEncoder()
    full = encode_pairs(enc, datasets, show_progress_bar=False)
    table = sentence_vectors(full, datasets)
    assert set(table) == {"x y", "p q", "z", "w", "new one"}
    marked = {s: -v for s, v in table.items() if s in ("x y", "z")}  # a vector only reuse can produce
    enc.calls.clear()
    out = encode_pairs(enc, datasets, known=marked, show_progress_bar=False)
    assert len(enc.calls) == 1 and sorted(enc.calls[0][0]) == ["new one", "p q", "w"]
    for name, data in datasets.items():
        for sents, vecs in zip((data.sentences1, data.sentences2), out[name]):
            for s, v in zip(sents, vecs):
                np.testing.assert_array_equal(v, marked[s] if s in marked else table[s])
    enc.calls.clear()
    again = encode_pairs(enc, datasets, known=table, show_progress_bar=False)
    assert enc.calls == []
    for name in datasets:
        np.testing.assert_array_equal(again[name][0], full[name][0])
        np.testing.assert_array_equal(again[name][1], full[name][1])


@pytest.mark.parametrize("as_tensor", [False, True], ids=["numpy", "torch"])
def test_score_sts_matches_an_independent_computation(tmp_path, as_tensor):
    rng = np.random.default_rng(3)
    words = "a man woman dog plays guitar runs park the sings loudly quietly".split()

    def sentence():
        return " ".join(rng.choice(words, size=rng.integers(2, 6)))

    write_year(tmp_path, "sts12", {s: [(sentence(), sentence(), f"{rng.uniform(0, 5):.2f}") for _ in range(15)]
                                   for s in ("MSRpar", "MSRvid", "SMTeuroparl")})
    write_stsb(tmp_path, {"test": [(sentence(), sentence(), round(rng.uniform(0, 5), 1)) for _ in range(30)]})
    datasets = load_sts_tasks(tmp_path, "stsb,sts12", preprocess="none")
    enc = HashEncoder(as_tensor=as_tensor)
    results = score_sts(enc, datasets, batch_size=8)
    assert list(results) == ["stsb", "sts12", "avg"]
    for name, data in datasets.items():
        assert results[name] == pytest.approx(reference_score(enc, data), abs=1e-6)
    assert results["avg"] == pytest.approx((results["stsb"] + results["sts12"]) / 2)
    # a single task has no average
    assert list(score_sts(enc, {"stsb": datasets["stsb"]})) == ["stsb"]


def test_evaluate_sts_reads_the_requested_split(tmp_path):
    write_all(tmp_path)
    write_stsb(tmp_path, {"dev": [("a b", "a b", 5.0), ("a c", "d e", 0.0), ("a b c", "a b", 3.0)],
                          "test": [("a b", "a b", 0.0), ("a c", "d e", 5.0), ("a b c", "a b", 3.0)]})
    enc = HashEncoder()
    dev = evaluate_sts(enc, tmp_path, "stsb", stsb_split="dev", preprocess="none")
    test = evaluate_sts(enc, tmp_path, ["stsb"], preprocess="none")
    assert dev["stsb"] == pytest.approx(100.0) and test["stsb"] == pytest.approx(-100.0)
    full = evaluate_sts(enc, tmp_path, preprocess="none", batch_size=4, show_progress_bar=False)
    assert list(full) == ["sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr", "avg"]
    assert enc.calls[-1][1:] == (4, False)


class BadEncoder:
    def __init__(self, fn):
        self.fn = fn

    def encode(self, sentences, batch_size=64, show_progress_bar=None):
        return self.fn(sentences)


def test_bad_encoder_output_is_a_clear_error():
    data = {"stsb": STSData("stsb", ["a", "b"], ["c", "d"], np.array([1.0, 2.0]))}
    with pytest.raises(ValueError, match=r"returned shape \(3, 4\) for 4 sentences"):
        score_sts(BadEncoder(lambda s: np.zeros((3, 4))), data)
    with pytest.raises(ValueError, match="returned shape"):
        score_sts(BadEncoder(lambda s: np.zeros(len(s))), data)
    with pytest.raises(ValueError, match="NaN or infinite"):
        score_sts(BadEncoder(lambda s: np.full((len(s), 4), np.nan)), data)
    with pytest.raises(ValueError, match="no STS task"):
        score_sts(HashEncoder(), {})
    with pytest.raises(ValueError, match="no sentences"):
        score_sts(HashEncoder(), {"x": STSData("x", [], [], np.zeros(0))})


def test_format_sts_table():
    table = format_sts_table({"sts12": 72.3690, "stsb": 82.0, "sickr": 77.145, "avg": 77.17133})
    assert table.splitlines() == [
        "+-------+-------+--------+-------+",
        "| STS12 | STS-B | SICK-R |  Avg. |",
        "+-------+-------+--------+-------+",
        "| 72.37 | 82.00 |  77.14 | 77.17 |",
        "+-------+-------+--------+-------+",
    ]
    assert "STS-B (dev)" in format_sts_table({"stsb": 1.0}, titles={"stsb": "STS-B (dev)"})
    with pytest.raises(ValueError, match="no results"):
        format_sts_table({})


def test_evaluate_sts_with_a_prompt_encoder(tmp_path, tiny_bert_dir):
    """The real encode() signature: PromptEncoder (tiny random BERT) scores equal a manual computation."""
    from fastprompt.model import PromptConfig, PromptEncoder

    write_all(tmp_path)
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2, init_std=0.5),
                                        pooler="mean")
    enc.train()  # evaluation must not depend on the mode it is handed
    datasets = load_sts_tasks(tmp_path, "sts15,stsb", preprocess="none")
    results = evaluate_sts(enc, tmp_path, "sts15,stsb", preprocess="none", batch_size=3)
    for name, data in datasets.items():
        e1, e2 = enc.encode(data.sentences1), enc.encode(data.sentences2)
        cos = (e1 * e2).sum(1) / np.linalg.norm(e1, axis=1) / np.linalg.norm(e2, axis=1)
        assert results[name] == pytest.approx(spearman_reference(cos, data.scores), abs=1e-3)

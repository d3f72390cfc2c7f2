"""The STS protocol on the real data reproduces all-MiniLM-L6-v2's published MTEB scores to 0.01.

Published numbers: cosine Spearman of sentence-transformers/all-MiniLM-L6-v2 in MTEB's results
repository, github.com/embeddings-benchmark/results,
results/sentence-transformers__all-MiniLM-L6-v2/8b3219a92973c328a8e22fadcfa821b5dc75636a/<Task>.json
(STS12 0.72369, STS13 0.8060316722, STS15 0.8538961998, STS16 0.7898945344, STSBenchmark 0.8203247283,
SICK-R 0.7758245525), and github.com/embeddings-benchmark/mtebpaper results/all-MiniLM-L6-v2/STS14.json
(STS14 0.7558912800; the STS12 file there agrees: 0.7236900735).

What MTEB's data are, in our loader's terms (found by reproducing them): STS12-16 are SentEval's
Moses-tokenised, lower-cased files (``preprocess="senteval"``; the raw files give STS14 75.60, off by
0.011); STSBenchmark is the raw test split; SICK-R is all 9,927 SICK pairs (train + trial + test), raw.
The model is sentence-transformers' all-MiniLM-L6-v2: mean pooling, max_seq_length 256.
"""
import pytest

from fastprompt.eval.sts import load_sickr, load_sts_tasks, load_stsb, score_sts

MTEB_ALL_MINILM_L6_V2 = {
    "sts12": 72.369, "sts13": 80.60317, "sts14": 75.58913, "sts15": 85.38962, "sts16": 78.98945,
    "stsb": 82.03247, "sickr_all": 77.58246,
}
# Scored pairs per task (the data README's table)
PAIRS = {"sts12": 3108, "sts13": 1500, "sts14": 3750, "sts15": 3000, "sts16": 1186}


@pytest.fixture(scope="module")
def sts_dir(shared_data):
    return shared_data / "sts"


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from fastprompt.model import PromptEncoder

    return PromptEncoder.from_pretrained(minilm_dir, pooler="mean", max_length=256).eval()


def test_real_files_pair_counts(sts_dir):
    data = load_sts_tasks(sts_dir, preprocess="none")
    assert {k: len(v) for k, v in data.items() if k in PAIRS} == PAIRS
    assert [len(load_stsb(sts_dir, s, preprocess="none")) for s in ("train", "dev", "test")] == [5749, 1500, 1379]
    assert [len(load_sickr(sts_dir, s, preprocess="none")) for s in ("train", "trial", "test", "all")] == \
        [4500, 500, 4927, 9927]
    # STS-B keeps bare quotes (no csv quoting); STS16 reads only the two sentence columns
    assert any(s.count('"') == 1 for s in data["stsb"].sentences1 + data["stsb"].sentences2)
    assert not any("\t" in s or "newsbrief" in s for s in data["sts16"].sentences1 + data["sts16"].sentences2)
    assert all(0.0 <= g <= 5.0 for d in data.values() for g in d.scores)


@pytest.mark.heavy  # the real MiniLM on real STS data: ~18 s
def test_minilm_reproduces_mteb_stsb_and_sts16(sts_dir, minilm):
    """STS-B test (raw) and STS16 (SentEval preprocessing: extra columns and unscored pairs) in one pass."""
    datasets = {"sts16": load_sts_tasks(sts_dir, "sts16")["sts16"], "stsb": load_stsb(sts_dir, preprocess="none")}
    results = score_sts(minilm, datasets, batch_size=64, show_progress_bar=False)
    for task in ("sts16", "stsb"):
        assert abs(results[task] - MTEB_ALL_MINILM_L6_V2[task]) < 0.01, (task, results[task])


@pytest.mark.slow
def test_minilm_reproduces_mteb_full_table(sts_dir, minilm):
    """All seven MTEB scores, and the papers' seven-task table (SentEval preprocessing, SICK-R test)."""
    datasets = load_sts_tasks(sts_dir)  # the papers' protocol
    datasets["stsb_raw"] = load_stsb(sts_dir, preprocess="none")
    datasets["sickr_all"] = load_sickr(sts_dir, "all", preprocess="none")
    results = score_sts(minilm, datasets, batch_size=64, show_progress_bar=False)
    for task, published in MTEB_ALL_MINILM_L6_V2.items():
        assert abs(results[task] - published) < 0.01, (task, results[task], published)
    assert abs(results["stsb_raw"] - MTEB_ALL_MINILM_L6_V2["stsb"]) < 0.01
    # SICK-R test alone (the papers' split) is a different number: measured 77.15
    assert abs(results["sickr"] - 77.15) < 0.01

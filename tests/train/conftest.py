"""Fixtures for trainer tests: a tiny corpus and a tiny STS folder in SentEval's layout (synthetic, fast)."""
import json
import random
import shutil
from pathlib import Path

import pytest

# Words the tiny test tokenizer (tests/conftest.py) knows, so sentences stay a few tokens long.
WORDS = ("man woman dog cat plays runs eating guitar ball park street car red blue big small "
         "two people one sits table water food").split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        out.add(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7))))
    return sorted(out)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(make_sentences(96)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_triplets(tmp_path_factory) -> Path:
    s = make_sentences(3 * 48, seed=1)
    path = tmp_path_factory.mktemp("nli") / "triplets.csv"
    path.write_text("sent0,sent1,hard_neg\n" + "".join(f"{s[i]},{s[i + 1]},{s[i + 2]}\n" for i in range(0, len(s), 3)),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_sts_dir(tmp_path_factory) -> Path:
    """Every file of the seven STS tasks, with 12 scored pairs each (same layout as ../shared/data/sts)."""
    from fastprompt.eval.sts import SICK_SPLITS, STS_YEAR_SUBSETS, STSB_SPLITS

    root = tmp_path_factory.mktemp("sts")
    rng = random.Random(7)
    sents = make_sentences(400, seed=2)

    def pairs(k=12):
        return [(rng.choice(sents), rng.choice(sents), round(rng.uniform(0, 5), 2)) for _ in range(k)]

    for folder, subsets in STS_YEAR_SUBSETS.values():
        d = root / folder
        d.mkdir()
        for sub in subsets:
            ps = pairs()
            (d / f"STS.input.{sub}.txt").write_text("".join(f"{a}\t{b}\n" for a, b, _ in ps), encoding="utf-8")
            (d / f"STS.gs.{sub}.txt").write_text("".join(f"{g}\n" for _, _, g in ps), encoding="utf-8")
    d = root / "STSBenchmark"
    d.mkdir()
    for name in STSB_SPLITS.values():
        d.joinpath(name).write_text("".join(f"g\tf\t2012\t{i:04d}\t{g}\t{a}\t{b}\n"
                                            for i, (a, b, g) in enumerate(pairs())), encoding="utf-8")
    d = root / "SICK"
    d.mkdir()
    for name in SICK_SPLITS.values():
        d.joinpath(name).write_text("pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
                                    + "".join(f"{i}\t{a}\t{b}\t{g}\tNEUTRAL\n" for i, (a, b, g) in enumerate(pairs())),
                                    encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_bert_masked_lm(tiny_bert_dir, tmp_path_factory) -> Path:
    """The tiny BERT's tokenizer and config saved as a BertForMaskedLM: a checkpoint with a ``cls.predictions``
    head (its transform included), as bert-base-uncased has one."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertForMaskedLM

    path = tmp_path_factory.mktemp("tiny-bert-masked-lm")
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(path)
    torch.manual_seed(4)
    BertForMaskedLM(AutoConfig.from_pretrained(tiny_bert_dir)).save_pretrained(path)
    return path


@pytest.fixture
def base_config(tiny_bert_dir, tiny_corpus, tmp_path):
    """Config keys of a fast run on the tiny BERT: 1 thread (bit-reproducible), no STS unless a test adds it."""

    def make(**overrides):
        cfg = dict(model=str(tiny_bert_dir), train_file=str(tiny_corpus), output_dir=str(tmp_path / "run"),
                   batch_size=8, max_length=16, prompt_length=4, learning_rate=1e-2, max_steps=8, eval_steps=4,
                   log_every=2, num_threads=1, progress_bar=False, seed=3)
        cfg.update(overrides)
        return cfg

    return make


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def no_dropout_bert(tiny_bert_dir, tmp_path_factory) -> Path:
    """The tiny BERT with dropout off, so that train mode (the BatchNorm head's batch statistics) is
    deterministic."""
    path = tmp_path_factory.mktemp("bert-no-dropout")
    for f in tiny_bert_dir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(cfg))
    return path

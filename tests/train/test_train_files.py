"""Several datasets in one run (train_files), and query/pos/neg rows, through the trainer on the tiny BERT."""
import csv
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.train import Trainer

from ..conftest import make_sentences

WIKI = "builtin:gensim-wiki"  # train_file's default: train_files replaces it


def _log_rows(run_dir):
    with open(Path(run_dir) / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def query_rows(tmp_path_factory):
    """24 FlagEmbedding rows: a query, a positive and 2 negatives each."""
    s = make_sentences(4 * 24, seed=5)
    path = tmp_path_factory.mktemp("rows") / "retrieval.jsonl"
    path.write_text("".join(json.dumps({"query": s[i], "pos": [s[i + 1]], "neg": [s[i + 2], s[i + 3]]}) + "\n"
                            for i in range(0, len(s), 4)), encoding="utf-8")
    return path


def test_two_datasets_log_each_ones_loss(base_config, tiny_corpus, tiny_triplets):
    cfg = base_config(train_file=WIKI, train_files=[str(tiny_corpus), str(tiny_triplets)], max_steps=6, log_every=2,
                      dataset_sampling="round_robin")
    seen = []
    summary = Trainer(cfg, callbacks=[lambda t, out: seen.append(out)]).train()
    assert summary["status"] == "completed"
    # round robin: corpus, triplets, corpus, ...; each step's loss is its dataset's column
    assert [next(k for k in out.stats if k.startswith("loss_data_")) for out in seen] == \
        ["loss_data_corpus", "loss_data_triplets"] * 3
    rows = _log_rows(cfg["output_dir"])
    assert {"loss_data_corpus", "loss_data_triplets"} <= set(rows[0])
    for row, (a, b) in zip(rows, zip(seen[::2], seen[1::2])):  # each log row: one step of each
        assert math.isclose(float(row["loss_data_corpus"]), a.loss, rel_tol=1e-5)
        assert math.isclose(float(row["loss_data_triplets"]), b.loss, rel_tol=1e-5)


def test_train_files_resume_bit_identical(base_config, tiny_corpus, query_rows, tmp_path):
    """Proportional sampling over a corpus and query/pos/neg rows, interrupted and resumed: the same prompt as
    the uninterrupted run (the sampler's plan resumes at the saved (epoch, batch))."""
    keys = dict(train_file=WIKI, train_files=[str(tiny_corpus), str(query_rows)], dataset_sampling="proportional",
                max_steps=12, save_steps=2, batch_size=8, negatives_per_row=1)
    ref = base_config(**keys, output_dir=str(tmp_path / "ref"))
    Trainer(ref).train()
    cfg = base_config(**keys, output_dir=str(tmp_path / "run"))

    def interrupt(trainer, out):
        if trainer.state.global_step == 7:
            os.kill(os.getpid(), signal.SIGINT)

    assert Trainer(cfg, callbacks=[interrupt]).train()["status"] == "interrupted"
    assert Trainer(cfg).train()["global_step"] == 12
    a, b = (load_file(str(tmp_path / run / "last" / "prompt.safetensors")) for run in ("ref", "run"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    names = [r for r in _log_rows(tmp_path / "run")[0] if r.startswith("loss_data_")]
    assert names == ["loss_data_corpus", "loss_data_retrieval"]


def test_train_files_settings_are_checked(base_config, tiny_corpus, tiny_triplets):
    with pytest.raises(ValueError, match="set train_files or train_file, not both"):
        Trainer(base_config(train_files=[str(tiny_corpus)]))  # base_config sets train_file
    with pytest.raises(ValueError, match="lists a file twice"):
        Trainer(base_config(train_file=WIKI, train_files=[str(tiny_corpus)] * 2))
    with pytest.raises(ValueError, match="pad_negatives pads rows up to negatives_per_row"):
        Trainer(base_config(pad_negatives=True))
    with pytest.raises(ValueError, match="negatives_per_row=1 is for query/positive/negative rows"):
        Trainer(base_config(train_file=WIKI, train_files=[str(tiny_corpus), str(tiny_triplets)],
                            negatives_per_row=1)).setup()


@pytest.mark.parametrize("spelling", ["dot-slash", "symlink", "hardlink"])
def test_one_file_under_two_names_is_refused(tiny_corpus, tmp_path, monkeypatch, spelling):
    """Issue 40, item 7: ``[tf/nli.csv, ./tf/nli.csv]`` trained the file twice per epoch (only the same spelling
    twice was refused): the paths are compared as files (resolved, symbolic and hard links too), before any is
    read."""
    from fastprompt.train.build import load_datasets
    from fastprompt.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    Path("tf").mkdir()
    Path("tf/corpus.txt").write_bytes(tiny_corpus.read_bytes())
    other = {"dot-slash": "./tf/corpus.txt", "symlink": "link.txt", "hardlink": "hard.txt"}[spelling]
    if spelling == "symlink":
        Path(other).symlink_to("tf/corpus.txt")
    elif spelling == "hardlink":
        os.link("tf/corpus.txt", other)
    cfg = TrainConfig(train_files=["tf/corpus.txt", other])
    with pytest.raises(ValueError, match=rf"train_files lists one file twice: 'tf/corpus.txt' and '{other}' are the "
                                         "same file"):
        load_datasets(cfg)
    Path("tf/copy.txt").write_bytes(tiny_corpus.read_bytes())  # a copy is another file: both train
    assert [len(d) for d in load_datasets(TrainConfig(train_files=["tf/corpus.txt", "tf/copy.txt"]))] == [96, 96]

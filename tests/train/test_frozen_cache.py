"""The frozen baseline's scores, cached (issue 40, item 22): a second run of the same model, STS pairs and protocol
takes them from the cache without encoding (the log says where the number came from), with the same numbers; another
model's weights or other pairs are computed again; ``frozen_cache: false`` (``--no-cache``) recomputes; an
unreadable entry is a warning and a recomputation."""
import json
import logging
import shutil

import pytest

from fastprompt.eval import frozen_cache
from fastprompt.train import Trainer
from fastprompt.train.evaluation import Evaluator


@pytest.fixture
def encodings(monkeypatch):
    """Counts the frozen model's encoding passes."""
    calls = []
    original = Evaluator._encode

    def counted(self, model, datasets, known=None, what=None):
        if model is not self.encoder:
            calls.append(sorted(datasets))
        return original(self, model, datasets, known, what)

    monkeypatch.setattr(Evaluator, "_encode", counted)
    return calls


def _run(base_config, tmp_path, name, **keys):
    cfg = base_config(sts_dir=keys.pop("sts_dir"), frozen_baseline=True, max_steps=2, eval_steps=2,
                      output_dir=str(tmp_path / name), **keys)
    return Trainer(cfg).train()


def test_a_second_run_takes_the_frozen_scores_from_the_cache(base_config, tiny_sts_dir, tmp_path, encodings,
                                                             caplog):
    first = _run(base_config, tmp_path, "a", sts_dir=str(tiny_sts_dir))
    assert encodings and len(list(frozen_cache.user_dir().glob("*.json"))) == 2  # dev, then the test tables
    encodings.clear()
    with caplog.at_level(logging.INFO, logger="fastprompt.train.evaluation"):
        second = _run(base_config, tmp_path, "b", sts_dir=str(tiny_sts_dir))
    assert encodings == []  # nothing of the frozen model encoded
    assert second["frozen_baseline"] == first["frozen_baseline"]
    assert caplog.text.count("from the cache") == 2 and str(frozen_cache.user_dir()) in caplog.text
    # --no-cache: computed again (and rewritten)
    third = _run(base_config, tmp_path, "c", sts_dir=str(tiny_sts_dir), frozen_cache=False)
    assert encodings and third["frozen_baseline"]["test"] == first["frozen_baseline"]["test"]


def test_other_pairs_or_other_weights_are_computed_again(base_config, tiny_sts_dir, tiny_roberta_dir, tmp_path,
                                                          encodings):
    _run(base_config, tmp_path, "a", sts_dir=str(tiny_sts_dir))
    changed = shutil.copytree(tiny_sts_dir, tmp_path / "sts2")
    gold = next(changed.rglob("sts-dev.csv"))
    lines = gold.read_text(encoding="utf-8").splitlines(True)
    fields = lines[0].split("\t")
    fields[4] = f"{(float(fields[4]) + 1) % 5:.2f}"  # one gold score of STS-B dev
    gold.write_text("\t".join(fields) + "".join(lines[1:]), encoding="utf-8")
    encodings.clear()
    _run(base_config, tmp_path, "b", sts_dir=str(changed))
    assert encodings  # another STS-B dev: recomputed
    encodings.clear()
    _run(base_config, tmp_path, "c", sts_dir=str(tiny_sts_dir), model=str(tiny_roberta_dir))
    assert encodings  # another model's weights: recomputed


def test_an_unreadable_entry_is_a_warning_and_a_recomputation(base_config, tiny_sts_dir, tmp_path, encodings,
                                                               caplog):
    first = _run(base_config, tmp_path, "a", sts_dir=str(tiny_sts_dir))
    for path in frozen_cache.user_dir().glob("*.json"):
        path.write_text("{not json")
    encodings.clear()
    with caplog.at_level(logging.WARNING, logger="fastprompt.eval.frozen_cache"):
        second = _run(base_config, tmp_path, "b", sts_dir=str(tiny_sts_dir))
    assert encodings and "not used" in caplog.text
    assert second["frozen_baseline"]["test"] == first["frozen_baseline"]["test"]
    assert all(json.loads(p.read_text())["key"] == p.stem for p in frozen_cache.user_dir().glob("*.json"))


def test_the_shipped_entries_are_the_quickstarts_frozen_scores(shared_data, minilm_dir, tmp_path, monkeypatch):
    """fastprompt/eval/frozen_scores/ holds the quickstart's frozen baseline (all-MiniLM-L6-v2, mean pooling, the
    shared STS sets, on a CPU with this torch): its keys are what a quickstart run computes, so even a first run takes
    them from there (78.87, the frozen model's published seven-task average here)."""
    from fastprompt.eval.sts import load_sts_tasks
    from fastprompt.train.config import load_config

    shipped = {p.stem: json.loads(p.read_text()) for p in frozen_cache.PACKAGE_DIR.glob("*.json")}
    assert shipped and all(entry["key"] == key for key, entry in shipped.items())
    root = frozen_cache.PACKAGE_DIR.parents[2]
    cfg = load_config(root / "configs" / "quickstart.yaml", {"sts_dir": str(shared_data / "sts"),
                                                            "output_dir": str(tmp_path / "run")})
    dev = load_sts_tasks(cfg.evaluation.sts_dir, ["stsb"], stsb_split="dev")
    test = load_sts_tasks(cfg.evaluation.sts_dir)
    evaluator = Evaluator(cfg, None, None, eval_autocast=None, device="cpu", dev_data=dev, probe=[], test_data=test)
    (setting,) = evaluator.frozen_settings
    frozen = evaluator._frozen_encoder(setting)
    dev_key, dev_entry, dev_path = evaluator._cached(frozen, setting, dev)
    test_key, test_entry, test_path = evaluator._cached(frozen, setting, {**test, "_dev": dev["stsb"]})
    assert dev_path.parent == test_path.parent == frozen_cache.PACKAGE_DIR
    assert round(test_entry["test"]["avg"], 2) == 78.87 and dev_entry["stsb_dev"] == test_entry["stsb_dev"]

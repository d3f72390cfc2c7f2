"""`fastprompt train` with the SKICSE recipes: the MiniLM one on a generate-ski output, supervised SKICSE with the
gradient cache, and the paper's full fine-tuning recipes (train_backbone=true) scaled down to the tiny BERT."""
import csv
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from fastprompt.train import Trainer, load_config

from ...train.test_cli import _main

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "data" / "fixtures" / "ski-wiki-10.csv"


def _log(run_dir):
    with open(run_dir / "train_log.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _write_triplets(path, n=None):
    """NLI-style rows (premise, a shortened entailment, a contradiction) with each premise's SKI from the fixture."""
    with open(FIXTURE, encoding="utf-8", newline="") as f:
        ski = list(csv.reader(f))[1:n]
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["sent0", "sent1", "hard_neg", "ski"])
        w.writerows([s, s.split(",")[0], f"not {i}", k] for i, (s, k) in enumerate(ski))
    return path


def test_the_minilm_recipe_trains_on_a_generate_ski_file(tiny_bert_dir, tiny_sts_dir, tmp_path, monkeypatch, capsys):
    """The documented command, `fastprompt train --config configs/skicse-unsup-minilm.yaml --set train_file=ski.csv`,
    with the model, STS folder and run length scaled down to the tiny test BERT."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(FIXTURE, "ski.csv")
    rc = _main(["train", "--config", str(ROOT / "configs" / "skicse-unsup-minilm.yaml"), "--set", "train_file=ski.csv",
                "--set", f"model={tiny_bert_dir}", "--set", f"sts_dir={tiny_sts_dir}", "--set", "batch_size=4",
                "--set", "max_steps=4", "--set", "eval_steps=2", "--set", "log_every=1", "--set", "num_threads=1",
                "--set", "progress_bar=false", "--set", "tensorboard=false"])
    assert rc == 0, capsys.readouterr().err
    run = tmp_path / "runs" / "skicse-unsup-minilm"
    rows = _log(run)
    assert [int(r["step"]) for r in rows if r["loss"]] == [1, 2, 3, 4]
    for r in rows:
        if r["loss"]:
            # the logged total is (1 - λ) L_simcse + λ L_ski of the logged terms
            want = 0.85 * float(r["loss_cl"]) + 0.15 * float(r["loss_ski"])
            assert abs(float(r["loss"]) - want) < 1e-4 * max(1.0, want) and r["loss_ski2"] == ""
    assert yaml.safe_load((run / "config.yaml").read_text())["objective"] == "skicse"
    assert (run / "best" / "prompt.safetensors").is_file()


def test_supervised_skicse_with_the_gradient_cache(base_config, tmp_path):
    """NLI rows with a ski column train through the gradient cache and log the three terms."""
    path = _write_triplets(tmp_path / "nli-ski.csv", 9)
    cfg = base_config(train_file=str(path), objective="skicse", batch_size=4, max_steps=2, max_length=24,
                      micro_batch_size=3, log_every=1, tensorboard=False)
    Trainer(cfg).train()
    rows = [r for r in _log(Path(cfg["output_dir"])) if r["loss"]]
    assert len(rows) == 2
    for r in rows:
        want = 0.6 * float(r["loss_cl"]) + 0.1 * float(r["loss_ski"]) + 0.3 * float(r["loss_ski2"])
        assert abs(float(r["loss"]) - want) < 1e-4 * max(1.0, want)


@pytest.mark.parametrize(("recipe", "weights"), [
    ("skicse-unsup-bert-base.yaml", {"loss_cl": 0.85, "loss_ski": 0.15}),
    ("skicse-sup-bert-base.yaml", {"loss_cl": 0.6, "loss_ski": 0.1, "loss_ski2": 0.3}),
])
def test_the_full_fine_tuning_recipes_train_the_backbone(recipe, weights, tiny_bert_dir, tmp_path):
    """The paper's setting as shipped (train_backbone=true, no prompt, objective=skicse), scaled down to the tiny
    BERT, through the gradient cache (micro-batches of 3 rows of a 4-row batch): the run completes, the backbone's
    weights move, and the logged loss is the recipe's weighted sum of the logged terms."""
    if "unsup" in recipe:
        train_file = tmp_path / "ski.csv"
        shutil.copy(FIXTURE, train_file)
    else:
        train_file = _write_triplets(tmp_path / "nli-ski.csv")
    cfg = load_config(ROOT / "configs" / recipe, dict(
        model=str(tiny_bert_dir), train_file=str(train_file), output_dir=str(tmp_path / "run"), batch_size=4,
        micro_batch_size=3, max_steps=2, max_length=24, precision="fp32", sts_dir=None, eval_steps=100, log_every=1,
        num_threads=1, progress_bar=False, tensorboard=False))
    assert cfg.to_dict()["train_backbone"] is True and cfg.to_dict()["objective"] == "skicse"
    trainer = Trainer(cfg)
    trainer.setup()
    before = {k: v.clone() for k, v in trainer.encoder.backbone.state_dict().items()}
    assert trainer.train()["status"] == "completed"
    after = trainer.encoder.backbone.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert "encoder.layer.0.attention.self.query.weight" in moved, moved
    rows = [r for r in _log(tmp_path / "run") if r["loss"]]
    assert [int(r["step"]) for r in rows] == [1, 2]
    for r in rows:
        # Each value is logged to 6 significant digits (relative rounding <= 5e-7 each), and the total is an fp32
        # sum of three terms of order 1 (~1e-7 relative): 1e-5 relative leaves a wide margin, while a wrong
        # weight (0.05 or more off) shifts the sum by >= 1e-2 relative.
        want = sum(w * float(r[k]) for k, w in weights.items())
        assert abs(float(r["loss"]) - want) < 1e-5 * max(1.0, want), r
        if "loss_ski2" not in weights:
            assert r["loss_ski2"] == ""

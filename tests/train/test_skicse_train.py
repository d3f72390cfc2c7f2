"""`fastprompt train` with the SKICSE recipe on a generate-ski output, and supervised SKICSE with the gradient cache."""
import csv
import shutil
from pathlib import Path

import yaml

from fastprompt.train import Trainer

from .test_cli import _main

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "fixtures" / "ski-wiki-10.csv"


def _log(run_dir):
    with open(run_dir / "train_log.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


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
    ski = [r for r in csv.reader(open(FIXTURE, encoding="utf-8", newline=""))][1:9]
    path = tmp_path / "nli-ski.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["sent0", "sent1", "hard_neg", "ski"])
        w.writerows([s, s.split(",")[0], f"not {i}", k] for i, (s, k) in enumerate(ski))
    cfg = base_config(train_file=str(path), objective="skicse", batch_size=4, max_steps=2, max_length=24,
                      micro_batch_size=3, log_every=1, tensorboard=False)
    Trainer(cfg).train()
    rows = [r for r in _log(Path(cfg["output_dir"])) if r["loss"]]
    assert len(rows) == 2
    for r in rows:
        want = 0.6 * float(r["loss_cl"]) + 0.1 * float(r["loss_ski"]) + 0.3 * float(r["loss_ski2"])
        assert abs(float(r["loss"]) - want) < 1e-4 * max(1.0, want)

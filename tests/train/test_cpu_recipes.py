"""The CPU recipes run end to end through `fastprompt train --config configs/<recipe>.yaml`, as documented, with
the model, data, STS folder and run length scaled down to the tiny test BERT (every other key as shipped)."""
import csv
from pathlib import Path

import pytest
import torch
import yaml

from .test_cli import _main

ROOT = Path(__file__).resolve().parents[2]

#: recipe -> loss columns train_log.csv must have (besides loss)
RECIPES = {
    "promptbert-unsup-minilm.yaml": (),
    "optiprompt-minilm.yaml": (),
    "simcse-unsup-minilm-full.yaml": (),
    "dcpcse-mlm-minilm.yaml": ("loss_mlm", "w_mlm"),
    "d2cse-unsup-minilm.yaml": ("loss_rtd", "w_rtd"),
}


def _log(run_dir):
    with open(run_dir / "train_log.csv", encoding="utf-8") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_cpu_recipe_trains_through_the_cli(name, tiny_bert_dir, tiny_corpus, tiny_sts_dir, tmp_path, monkeypatch,
                                           capsys):
    monkeypatch.chdir(tmp_path)
    recipe = yaml.safe_load((ROOT / "configs" / name).read_text(encoding="utf-8"))
    sets = dict(model=tiny_bert_dir, train_file=tiny_corpus, sts_dir=tiny_sts_dir, batch_size=8, max_steps=3,
                eval_steps=2, log_every=1, num_threads=1, progress_bar="false", tensorboard="false")
    argv = ["train", "--config", str(ROOT / "configs" / name)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    rc = _main(argv)
    assert rc == 0, capsys.readouterr().err
    run = tmp_path / recipe["output_dir"]
    rows = [r for r in _log(run) if r["loss"]]
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert all(float(r[c]) > 0 for r in rows for c in RECIPES[name] if c.startswith("loss"))
    saved = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    shipped = {k: v for k, v in recipe.items() if k not in sets and k not in ("base", "output_dir")}
    assert {k: saved[k] for k in shipped} == {k: _as_saved(v) for k, v in shipped.items()}
    assert (run / "best").is_dir() and (run / "summary.json").is_file()
    if name == "simcse-unsup-minilm-full.yaml":
        from transformers import AutoModel

        tuned = AutoModel.from_pretrained(run / "best")
        base = AutoModel.from_pretrained(tiny_bert_dir)
        changed = [n for n, p in tuned.state_dict().items() if not torch.equal(p, base.state_dict()[n])]
        assert any(n.startswith("encoder.layer.") for n in changed)  # the backbone itself was trained


def _as_saved(value):
    """YAML's 3e-5 is a string to yaml.safe_load; the saved config holds the resolved float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value

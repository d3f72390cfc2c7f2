"""docs/methods.md's "Adding a method", followed literally: a folder (tests/train/toy_method/: a config section,
a sentence objective, a token term and its builder) whose __init__.py holds the one registration call. Importing it
is all it takes for the method's keys, objective, term and run-identity keys to reach ``fastprompt train``."""
from __future__ import annotations

import csv
import importlib
import json
import sys
from pathlib import Path

import pytest
import yaml


@pytest.fixture
def toy(monkeypatch):
    from fastprompt.methods import unregister_method

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    package = importlib.import_module("toy_method")  # runs its one register_method(...) line
    try:
        yield package
    finally:
        unregister_method("toy")
        for name in [m for m in sys.modules if m == "toy_method" or m.startswith("toy_method.")]:
            del sys.modules[name]


def test_a_method_in_one_folder_trains_through_the_cli_and_its_keys_are_run_identity(toy, base_config, tmp_path,
                                                                                      capsys):
    from fastprompt.cli import main
    from fastprompt.train.config import RUN_IDENTITY_KEYS, TrainConfig
    from fastprompt.train.config_doc import config_reference_markdown

    cfg = TrainConfig(objective="toy", toy_weight=0.5)
    assert (cfg.toy.weight, cfg.toy_rate, cfg.loss.name) == (0.5, 0.3, "toy")
    assert {"toy_weight", "toy_rate"} <= set(RUN_IDENTITY_KEYS) and "toy_note" not in RUN_IDENTITY_KEYS
    assert "`toy_weight`" in config_reference_markdown()
    with pytest.raises(ValueError, match="toy_rate must be < 1"):
        TrainConfig(toy_rate=1.0)

    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(base_config(objective="toy", toy_weight=0.5, max_steps=2, log_every=1,
                                                 sts_dir=None)), encoding="utf-8")
    assert main(["train", "--config", str(recipe)]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 2
    rows = [r for r in csv.DictReader((run / "train_log.csv").open()) if r["loss"]]
    assert [r["step"] for r in rows] == ["1", "2"]
    assert all(float(r["loss_toy"]) > 0 and float(r["w_toy"]) == 0.5 and r["pos_cos"] for r in rows)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert (saved["objective"], saved["toy_weight"], saved["toy_rate"]) == ("toy", 0.5, 0.3)

    # toy_weight is run identity (its field's flag): resuming with another value is refused ...
    capsys.readouterr()
    assert main(["train", "--config", str(recipe), "--set", "max_steps=3", "--set", "toy_weight=0.2"]) == 2
    assert "toy_weight: 0.5 -> 0.2" in capsys.readouterr().err
    # ... toy_note is not: the run resumes
    assert main(["train", "--config", str(recipe), "--set", "max_steps=3", "--set", "toy_note=resumed"]) == 0
    assert json.loads((run / "summary.json").read_text())["global_step"] == 3


def test_registration_refuses_clashes_and_an_unregistered_method_leaves_no_key(toy):
    from fastprompt.methods import METHODS, MethodSpec, register_method, unregister_method
    from fastprompt.methods.mlm.config import MLMConfig
    from fastprompt.objectives.config import OBJECTIVE_REGISTRY
    from fastprompt.train.config import TrainConfig

    with pytest.raises(ValueError, match="method 'toy' is already registered"):
        register_method(MethodSpec("toy", doc="docs/methods.md"))
    with pytest.raises(ValueError, match="config section 'mlm' is method 'mlm'"):
        register_method(MethodSpec("toy2", doc="docs/methods.md", section=("mlm", MLMConfig, "again")))
    with pytest.raises(ValueError, match="terms is a callable or 'module:attr'"):
        register_method(MethodSpec("toy2", doc="docs/methods.md", terms="toy_method.terms.toy_terms"))
    assert "toy2" not in METHODS and "toy2" not in OBJECTIVE_REGISTRY
    # a section whose flat keys clash with another's is refused when a config is built
    register_method(MethodSpec("toy2", doc="docs/methods.md", section=("mlm_again", MLMConfig, "again")))
    try:
        with pytest.raises(ValueError, match="config key 'do_mlm' of section 'mlm_again' is taken"):
            TrainConfig()
    finally:
        unregister_method("toy2")
    spec = unregister_method("toy")
    try:
        with pytest.raises(ValueError, match="unknown config key 'toy_weight'"):
            TrainConfig(toy_weight=0.5)
        with pytest.raises(ValueError, match="objective must be one of simcse, promcse_eh, skicse; got 'toy'"):
            TrainConfig(objective="toy")
    finally:
        register_method(spec)

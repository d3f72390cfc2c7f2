"""docs/objectives.md's "Writing a sentence-level objective", followed step by step with a toy objective that
then trains through ``fastprompt train``: the steps the page lists are all it takes."""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import yaml

from fastprompt.objectives import ObjectiveOutput, SentenceObjective, Views
from fastprompt.objectives.config import OBJECTIVE_REGISTRY, objective_default


# Step 1: a SentenceObjective dataclass whose fields are named after ObjectiveConfig keys, with their defaults.
@dataclass
class ToyAlignment(SentenceObjective):
    """Alignment only (no negatives): mean over anchors of (1 - cos(anchor, its positive)) / temperature."""

    temperature: float = objective_default("temperature")
    scale: float = 1.0  # no config key: keeps this default

    name = "toy_alignment"
    stat_names = ("pos_cos",)

    def loss(self, views: Views) -> ObjectiveOutput:
        anchors = views.local[0]
        positives = views.gathered[1, views.positive_offset:views.positive_offset + anchors.shape[0]]
        cos = F.cosine_similarity(anchors.float(), positives.float(), dim=-1)
        return ObjectiveOutput(self.scale * (1 - cos).mean() / self.temperature, {"pos_cos": cos.mean().item()})


@pytest.fixture
def registered():
    # Step 3: one registration call.
    from fastprompt.objectives import register_objective

    register_objective("toy_alignment", ToyAlignment)
    try:
        yield
    finally:
        del OBJECTIVE_REGISTRY["toy_alignment"]


def test_a_registered_objective_is_built_from_the_config_and_trains_through_the_cli(registered, base_config,
                                                                                     tmp_path):
    from fastprompt.cli import main
    from fastprompt.objectives import build_objective, objective_from_config
    from fastprompt.train import TrainConfig

    obj = objective_from_config(TrainConfig(objective="toy_alignment", temperature=0.5).loss)
    assert obj == ToyAlignment(temperature=0.5, scale=1.0)
    z = torch.randn(2, 4, 8)
    expected = (1 - F.cosine_similarity(z[0], z[1], dim=-1)).mean() / 0.5
    torch.testing.assert_close(obj(z).loss, expected)
    with pytest.raises(ValueError, match="does not use hinge_margin"):
        objective_from_config(TrainConfig(objective="toy_alignment", hinge_margin=0.4).loss)
    with pytest.raises(ValueError, match="takes no backend"):
        build_objective("toy_alignment", backend="reference")

    cfg = base_config(objective="toy_alignment", temperature=0.5, max_steps=2, log_every=1, sts_dir=None)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    assert main(["train", "--config", str(recipe)]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 2
    rows = list(csv.DictReader((run / "train_log.csv").open()))
    assert [r["step"] for r in rows if r["loss"]] == ["1", "2"] and "pos_cos" in rows[0]
    assert all(0 <= float(r["loss"]) <= 2 / 0.5 for r in rows if r["loss"])  # (1 - cos) / temperature
    assert yaml.safe_load((run / "config.yaml").read_text())["objective"] == "toy_alignment"


def test_an_unregistered_objective_is_refused_with_the_registered_names():
    from fastprompt.train import TrainConfig

    with pytest.raises(ValueError, match="objective must be one of simcse, promcse_eh, skicse; got 'toy_alignment'"):
        TrainConfig(objective="toy_alignment")

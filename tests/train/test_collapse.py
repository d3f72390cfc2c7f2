"""Representation collapse (every sentence one direction) is logged, warned about, and stops the run."""
import csv
import json
from pathlib import Path

import pytest
import torch

from fastprompt.train import Trainer, TrainingCollapsed, TrainingDiverged
from fastprompt.train.collapse import CollapseMonitor, embedding_spread


def test_embedding_spread():
    g = torch.Generator().manual_seed(0)
    assert embedding_spread(torch.randn(1, 8, generator=g).repeat(16, 1) * torch.rand(16, 1) + 0) < 1e-6
    spread = embedding_spread(torch.randn(4096, 64, generator=g, dtype=torch.float64))
    assert abs(spread - (1 - 1 / 4096)) < 0.01  # |mean|^2 of n random unit vectors in 64 dims ~ 1/n


def test_monitor_warns_once_then_stops_after_patience(caplog):
    m = CollapseMonitor(1e-2, patience=3, start=0.25)
    assert [m.update(s, v) for s, v in enumerate([0.3, 1e-6, 1e-7, 0.2, 0.0, 0.0, 0.0], 1)] == \
        [False, False, False, False, False, False, True]
    assert caplog.text.count("representation collapse") == 2  # once per streak
    assert not any(CollapseMonitor(1e-2, patience=0, start=0.25).update(s, 0.0) for s in range(10))  # warn only
    assert not CollapseMonitor(0.0, patience=1, start=0.25).update(1, 0.0)  # check off
    assert not CollapseMonitor(1e-2, patience=1, start=0.0).update(1, 0.0)  # a base model without spread


def test_huge_learning_rate_collapses_and_stops_with_a_message(base_config, caplog):
    cfg = base_config(learning_rate=1e6, max_steps=40, log_every=1, collapse_patience=2, save_steps=1)
    with pytest.raises(TrainingCollapsed, match=r"representation collapse in 2 consecutive checks.*lower "
                                                r"learning_rate") as info:
        Trainer(cfg).train()
    assert isinstance(info.value, TrainingDiverged)  # the CLI's exit status 3
    assert "representation collapse" in caplog.text
    with open(Path(cfg["output_dir"]) / "train_log.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["loss"]]
    assert len(rows) < 40
    saved = json.loads((Path(cfg["output_dir"]) / "last" / "training_state.json").read_text())["trainer"]["state"]
    threshold = 1e-2 * saved["probe_spread_start"]
    assert float(rows[-1]["emb_spread"]) < threshold and float(rows[-2]["emb_spread"]) < threshold


def test_healthy_run_logs_spread_and_never_warns(base_config, caplog):
    cfg = base_config(max_steps=4, log_every=2)
    assert Trainer(cfg).train()["status"] == "completed"
    with open(Path(cfg["output_dir"]) / "train_log.csv", newline="") as f:
        spreads = [float(r["emb_spread"]) for r in csv.DictReader(f) if r["loss"]]
    assert len(spreads) == 2 and all(s > 0 for s in spreads)
    assert "collapse" not in caplog.text

"""Large-batch machinery inside the Trainer: gradient cache, gradient checkpointing, two processes."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fastprompt.train import Trainer
from fastprompt.train.config import TrainConfig, parse_overrides


def _prompt(run_dir):
    return load_file(str(Path(run_dir) / "last" / "prompt.safetensors"))


def _assert_close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=atol, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def no_dropout_bert(tiny_bert_dir, tmp_path_factory):
    """The tiny BERT with dropout off: then different micro-batchings must give the same training run."""
    path = tmp_path_factory.mktemp("bert-no-dropout")
    for f in tiny_bert_dir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_large_batch_keys_from_set_and_validation():
    cfg = TrainConfig.from_dict(parse_overrides(["micro_batch_size=16", "max_tokens_per_micro_batch=512",
                                                 "gradient_checkpointing=true"]))
    assert cfg.micro_batch_size == 16 and cfg.max_tokens_per_micro_batch == 512 and cfg.gradient_checkpointing
    assert cfg.gradient_cache and not TrainConfig().gradient_cache
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(micro_batch_size=-1)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        TrainConfig(max_tokens_per_micro_batch=8, max_length=32)


class _GradRecorder(Trainer):
    """A Trainer that keeps a copy of every step's gradients (taken just before the optimizer uses them)."""

    def optimizer_step(self):
        self.recorded = getattr(self, "recorded", [])
        self.recorded.append({n: p.grad.clone() for n, p in self.encoder.named_parameters() if p.requires_grad})
        return super().optimizer_step()


def _assert_same_gradients(a, b):
    # Relative to each tensor's largest entry: contrastive gradients are sums of many nearly cancelling terms,
    # so float rounding shows up at ~1e-4 of the result; a wrong dropout replay or padding shows up at ~1.
    assert a.keys() == b.keys()
    for k in a:
        scale = a[k].abs().max()
        assert scale > 0, f"{k}: zero gradient, the comparison would be vacuous"
        assert (a[k] - b[k]).abs().max() <= 1e-3 * scale, f"{k}: {(a[k] - b[k]).abs().max()} vs scale {scale}"


@pytest.mark.parametrize("keys", [dict(micro_batch_size=3), dict(max_tokens_per_micro_batch=40)])
def test_gradient_cache_training_matches_plain_training(base_config, no_dropout_bert, tiny_triplets, tmp_path, keys):
    # Triplets: with dropout off, two views of one sentence would be identical and the loss nearly flat.
    # One step: Adam's update lr * g / |g| would turn rounding-level differences of near-zero components into
    # lr-sized parameter differences, so later steps would not start from the same prompt.
    plain = base_config(model=str(no_dropout_bert), output_dir=str(tmp_path / "plain"), max_steps=1, eval_steps=1,
                        train_file=str(tiny_triplets), objective="promcse_eh", mlp="always")
    runs = []
    for cfg in (plain, dict(plain, output_dir=str(tmp_path / "cached"), **keys)):
        trainer = _GradRecorder(cfg)
        trainer.train()
        runs.append(trainer.recorded)
    assert len(runs[0]) == len(runs[1]) == 1
    _assert_same_gradients(runs[0][0], runs[1][0])


def test_gradient_checkpointing_training_is_identical_with_dropout_on(base_config, tmp_path):
    ref = base_config(output_dir=str(tmp_path / "ref"), max_steps=3, eval_steps=3, prompt_dropout=0.1)
    Trainer(ref).train()
    Trainer(dict(ref, output_dir=str(tmp_path / "ckpt"), gradient_checkpointing=True)).train()
    _assert_close(_prompt(tmp_path / "ckpt"), _prompt(tmp_path / "ref"), atol=1e-6)


def test_torchrun_two_processes_train_like_one(base_config, no_dropout_bert, tiny_triplets, tmp_path):
    """`torchrun --nproc_per_node 2 fastprompt train`: each process takes half of every global batch and
    contrasts against all of it; the prompt after one step equals the single-process run's.

    Adam's first step is lr * g / (|g| + eps); with eps = 1 and lr = 300 it is ~300 g, so parameters that
    agree within 5e-5 mean gradients that agree within ~2e-7 (their scale here is ~1e-5), and a run whose
    processes did not see each other's negatives would be off by ~100%."""
    common = base_config(model=str(no_dropout_bert), max_steps=1, eval_steps=1, mlp="always",
                         train_file=str(tiny_triplets), objective="promcse_eh", micro_batch_size=2,
                         adam_epsilon=1.0, learning_rate=300.0)
    single = dict(common, output_dir=str(tmp_path / "single"))
    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(yaml.safe_dump(dict(common, output_dir=str(tmp_path / "two"))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "fastprompt.cli", "train", "--config", str(cfg_file)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer = Trainer(single)
    trainer.setup()
    initial = trainer.encoder.prompt_state_dict()["prompt.prefix"].clone()
    trainer.train()
    assert (_prompt(tmp_path / "single")["prompt.prefix"] - initial).abs().max() > 1e-3  # not vacuous
    _assert_close(_prompt(tmp_path / "two"), _prompt(tmp_path / "single"), atol=5e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["global_step"] == 1 and summary["status"] == "completed"

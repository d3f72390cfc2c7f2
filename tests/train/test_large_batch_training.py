"""Large-batch machinery inside the Trainer: gradient cache, gradient checkpointing, two processes."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fastprompt.model.lora import adapter_state_dict
from fastprompt.train import Trainer
from fastprompt.train.config import TrainConfig, parse_overrides

from .numerics import CHAIN_ULPS, U32, assert_same_gradients, conditioning


def _prompt(run_dir):
    return load_file(str(Path(run_dir) / "last" / "prompt.safetensors"))


def _assert_close(a, b, atol):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=atol, msg=lambda m, k=k: f"{k}: {m}")


def test_large_batch_keys_from_set_and_validation():
    cfg = TrainConfig.from_dict(parse_overrides(["micro_batch_size=16", "max_tokens_per_micro_batch=512",
                                                 "gradient_checkpointing=true"]))
    assert cfg.micro_batch_size == 16 and cfg.max_tokens_per_micro_batch == 512 and cfg.gradient_checkpointing
    assert cfg.gradient_cache and not TrainConfig().gradient_cache
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(micro_batch_size=-1)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        TrainConfig(max_tokens_per_micro_batch=8, max_length=32)


# ------------------------------------------------------------------ comparing two float32 training runs
# The runs below evaluate the same float32 function of the same inputs in a different order of operations
# (micro-batch shapes change GEMM blocking and the order in which rows are summed; two processes all-reduce two
# halves), so their gradients differ by rounding alone: the rtol of tests/train/numerics.py ("different forward",
# ~7e-4 at this test's kappa ~ 5; measured differences are ~1e-6 with AVX-512 and AVX2/SSE MKL code paths alike),
# after its conditioning check. Mean pooling: the tiny BERT's [CLS] vectors fail that check (cosines all within
# 1.5e-5 of 1, hardest negatives tied within 4e-9); mean pooling gives cosines <= 0.98.


class _GradRecorder(Trainer):
    """A Trainer that keeps every step's embeddings and gradients (taken just before the optimizer uses them)."""

    def _setup(self, cfg):
        super()._setup(cfg)
        self.embeddings = []
        side = self.step.loss_side
        sentence = side.sentence

        def keep(reps, batch):  # the (views, B, H) post-head embeddings the sentence objective sees
            loss, out, emb = sentence(reps, batch)
            self.embeddings.append(emb.detach().clone().view(batch.n_views, batch.batch_size, -1))
            return loss, out, emb

        side.sentence = keep

    def optimizer_step(self, finite_loss=None):
        self.recorded = getattr(self, "recorded", [])
        self.recorded.append({n: p.grad.clone() for n, p in self.encoder.named_parameters() if p.requires_grad})
        return super().optimizer_step(finite_loss)


@pytest.mark.parametrize("keys", [dict(micro_batch_size=3), dict(max_tokens_per_micro_batch=40)])
def test_gradient_cache_training_matches_plain_training(base_config, no_dropout_bert, tiny_triplets, tmp_path, keys):
    # Triplets: with dropout off, two views of one sentence would be identical and the loss nearly flat.
    # One step: Adam's update lr * g / |g| would turn rounding-level differences of near-zero components into
    # lr-sized parameter differences, so later steps would not start from the same prompt.
    plain = base_config(model=str(no_dropout_bert), output_dir=str(tmp_path / "plain"), max_steps=1, eval_steps=1,
                        train_file=str(tiny_triplets), objective="promcse_eh", pooler="mean", mlp="always")
    runs = []
    for cfg in (plain, dict(plain, output_dir=str(tmp_path / "cached"), **keys)):
        trainer = _GradRecorder(cfg)
        trainer.train()
        runs.append(trainer)
    assert len(runs[0].recorded) == len(runs[1].recorded) == 1
    # the loss sees the same embeddings (the forward half of the chain: well within CHAIN_ULPS of their scale)
    emb_plain, emb_cached = runs[0].embeddings[0], runs[1].embeddings[0]
    assert (emb_cached - emb_plain).abs().max() <= CHAIN_ULPS * U32 * emb_plain.abs().max()
    rtol = conditioning(runs[0].embeddings[0], temperature=0.05, margin=0.2)
    assert_same_gradients(runs[0].recorded[0], runs[1].recorded[0], rtol)


def test_gradient_checkpointing_training_is_identical_with_dropout_on(base_config, tmp_path):
    ref = base_config(output_dir=str(tmp_path / "ref"), max_steps=3, eval_steps=3, prompt_dropout=0.1)
    Trainer(ref).train()
    Trainer(dict(ref, output_dir=str(tmp_path / "ckpt"), gradient_checkpointing=True)).train()
    _assert_close(_prompt(tmp_path / "ckpt"), _prompt(tmp_path / "ref"), atol=1e-6)


#: the trained tensors' file in last/ and how to take their initial values from a set-up trainer, per tuning mode
_TRAINED = {
    "prompt": ("prompt.safetensors", lambda enc: enc.prompt_state_dict()),
    "lora": ("adapter_model.safetensors", lambda enc: adapter_state_dict(enc.backbone)),
    "full": ("model.safetensors", lambda enc: enc.backbone.state_dict()),
}
#: the modes without a prompt take supervised SimCSE (no hinge): the untouched tiny BERT's mean-pooled triplets
#: have a near-tie of hardest negatives (6.2e-5 apart), which would let rounding pick the hinge's negative
_MODE_KEYS = {"prompt": dict(objective="promcse_eh"),
              "lora": dict(prompt_type="none", lora=True, lora_dropout=0.0, objective="simcse"),
              "full": dict(prompt_type="none", train_backbone=True, objective="simcse")}


def _first_step_gradients(run_dir, initial, lr, name="prompt.safetensors"):
    """The (clipped) gradients of a one-step run, recovered from the tensors it saved: with adam_epsilon = 1 AdamW's
    first step is p1 = p0 - lr * g / (|g| + 1) (bias-corrected moments m = g, v = g^2; no weight decay), a smooth
    function of g that inverts exactly as g = (p0 - p1) / (lr - |p0 - p1|). (With the default epsilon the step is
    lr * sign(g), which turns rounding-level differences of near-zero gradient entries into lr-sized ones.)"""
    saved = load_file(str(Path(run_dir) / "last" / name))
    assert saved.keys() == initial.keys() and saved
    out = {}
    for k in saved:
        step = initial[k].double() - saved[k].double()
        out[k] = step / (lr - step.abs())
    return out


@pytest.mark.heavy  # two torchrun processes
@pytest.mark.parametrize("mode", list(_TRAINED))
def test_torchrun_two_processes_train_like_one(base_config, no_dropout_bert, tiny_triplets, tmp_path, mode):
    """`torchrun --nproc_per_node 2 fastprompt train`: each process takes half of every global batch and
    contrasts against all of it; the step it takes equals the single-process run's, up to rounding (the gradients
    compared as in the gradient-cache test; a run whose processes did not see each other's negatives would be off by
    O(1)). In each tuning mode (docs/tuning-modes.md): the prompt, LoRA's adapters, the whole backbone. (Tensors
    without a gradient in the first step, LoRA's A matrices while B is zero and BERT's unused pooler, are left
    out of the comparison when both runs leave them where they were, and the key biases, whose gradient is zero
    but for rounding.)"""
    lr = 10.0  # how far the step moves the weights: far above the rounding of p0 - p1 (p0 ~ 0.02 to 0.2)
    common = base_config(model=str(no_dropout_bert), max_steps=1, eval_steps=1, pooler="mean", mlp="always",
                         train_file=str(tiny_triplets), micro_batch_size=2,
                         adam_epsilon=1.0, learning_rate=lr, lora_learning_rate=lr, backbone_learning_rate=lr,
                         **_MODE_KEYS[mode])
    single = dict(common, output_dir=str(tmp_path / "single"))
    cfg_file = tmp_path / "two.yaml"
    cfg_file.write_text(yaml.safe_dump(dict(common, output_dir=str(tmp_path / "two"))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "fastprompt.cli", "train", "--config", str(cfg_file)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer = _GradRecorder(single)
    trainer.setup()
    name, initial_of = _TRAINED[mode]
    initial = {k: v.detach().clone() for k, v in initial_of(trainer.encoder).items()}
    trainer.train()
    rtol = conditioning(trainer.embeddings[0], temperature=0.05, margin=0.2 if mode == "prompt" else None)
    one, two = (_first_step_gradients(tmp_path / run, initial, lr, name) for run in ("single", "two"))
    # a key bias shifts every score of a query alike, which softmax ignores: its gradient is zero but for rounding
    moved = [k for k in one if (one[k].any() or two[k].any()) and not k.endswith("attention.self.key.bias")]
    assert len(moved) >= len(one) // 2, (len(moved), len(one))  # LoRA: every B matrix
    assert_same_gradients({k: one[k] for k in moved}, {k: two[k] for k in moved}, rtol)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["global_step"] == 1 and summary["status"] == "completed"

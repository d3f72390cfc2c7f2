"""Full fine-tuning (train_backbone): gradient-cache equality with trainable weights, own optimizer group,
Hugging Face layout checkpoints, exact resume, and resume refused across modes.

Tolerance of the gradient comparison as in tests/train/test_steps.py: both sides run the same fp32 kernels on
the same rows with the same dropout masks; only the summation order of the gradient contributions differs (a
few float32 ulps on gradients of order 1e-3..1), so atol = rtol = 1e-5 leaves two orders of margin.
"""
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.data import Collator
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.objectives import Method
from fastprompt.train import Trainer
from fastprompt.train.distributed import DistributedContext
from fastprompt.train.grad_cache import make_micro_batches, plan_micro_batches
from fastprompt.train.steps import CachedStep, LossSide

SENTS = ["a man plays the guitar .", "the dog runs", "two people sit at a big table with water .", "it",
         "a woman is eating food in the park", "the cat sits"]
SEED = 5


@pytest.mark.parametrize("model,checkpointing", [("bert", False), ("roberta", False), ("bert", True)])
def test_cached_gradients_equal_full_batch_with_a_trainable_backbone(request, model, checkpointing):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(request.getfixturevalue(f"tiny_{model}_dir"),
                                        prompt_config=PromptConfig(3, prompt_dropout=0.1), pooler="cls",
                                        mlp="train").train_backbone().train()
    if checkpointing:
        enc.gradient_checkpointing_enable()
    method = Method(SimCSE(temperature=0.05, backend="reference"))
    batch = Collator(enc.tokenize, 32)([(s,) for s in SENTS])
    groups = plan_micro_batches(batch.attention_mask, 4)
    assert len(groups) > 1

    torch.manual_seed(SEED)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in make_micro_batches(batch.model_inputs(), groups):
        reps = reps.index_put((mb.rows,), enc(**mb.inputs, head=False))
    ref_loss = method.sentence(enc.pooler.head(reps).view(2, len(SENTS), -1)).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    assert "backbone.encoder.layer.0.attention.self.query.weight" in ref and "prompt.prefix" in ref

    enc.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    out = CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=4, max_tokens=None)(batch, 0, SEED)
    torch.testing.assert_close(torch.tensor(out.loss), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    got = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(float(g.abs().sum()) for n, g in ref.items() if n.startswith("backbone.")) > 0


def _full_config(base_config, **extra):
    keys = dict(train_backbone=True, backbone_learning_rate=1e-3, backbone_weight_decay=0.01, mlp="train",
                max_steps=6, eval_steps=100, save_steps=2, log_every=1, prompt_dropout=0.1)
    return base_config(**{**keys, **extra})


def test_full_fine_tuning_trains_saves_hf_layout_and_loads(base_config, tiny_bert_dir):
    from transformers import AutoModel

    cfg = _full_config(base_config)
    trainer = Trainer(cfg)
    trainer.setup()
    groups = trainer.optimizer.param_groups
    assert len(groups) == 3  # the rest; the backbone's decayed weights; its biases and LayerNorm weights
    assert groups[1]["weight_decay"] == 0.01 and groups[0]["weight_decay"] == 0.0 and groups[2]["weight_decay"] == 0
    assert groups[1]["initial_lr"] == groups[2]["initial_lr"] == 1e-3 and groups[0]["initial_lr"] == 1e-2
    before = {k: v.clone() for k, v in trainer.encoder.backbone.state_dict().items()}
    assert trainer.train()["status"] == "completed"
    after = trainer.encoder.backbone.state_dict()
    assert not torch.equal(before["encoder.layer.0.attention.self.query.weight"],
                           after["encoder.layer.0.attention.self.query.weight"])
    best = trainer.best_dir
    hf = AutoModel.from_pretrained(best)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, after[k]), k
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in Path(best).iterdir())
    reloaded = PromptEncoder.load(best)
    assert reloaded.backbone_trained
    sents = ["a dog runs in the park", "two people sit"]
    torch.testing.assert_close(reloaded.encode(sents), trainer.encoder.encode(sents))
    # the base model on disk is untouched, and a prompt-only load of it gives other embeddings
    base = AutoModel.from_pretrained(tiny_bert_dir)
    assert torch.equal(base.state_dict()["encoder.layer.0.attention.self.query.weight"],
                       before["encoder.layer.0.attention.self.query.weight"])


def test_the_log_has_the_backbone_learning_rate_beside_the_prompts(base_config, tmp_path):
    """lr is the prompt/head group's rate, backbone_lr the backbone group's (both follow the linear decay);
    a prompt-only run has no backbone_lr column."""
    import csv

    def log(cfg):
        Trainer(cfg).train()
        with open(Path(cfg["output_dir"]) / "train_log.csv", newline="") as f:
            reader = csv.DictReader(f)
            return reader.fieldnames, [r for r in reader if r["loss"]]

    header, rows = log(_full_config(base_config, max_steps=3, output_dir=str(tmp_path / "full")))
    assert header[header.index("lr") + 1] == "backbone_lr"
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for r in rows:  # after step s the schedule is at (3 - s) / 3 of each group's peak
        decay = (3 - int(r["step"])) / 3
        assert float(r["lr"]) == pytest.approx(1e-2 * decay, rel=1e-5)
        assert float(r["backbone_lr"]) == pytest.approx(1e-3 * decay, rel=1e-5)
    header, _ = log(base_config(max_steps=1, output_dir=str(tmp_path / "prompt")))
    assert "backbone_lr" not in header and "lr" in header


def test_full_fine_tuning_resumes_bit_for_bit_with_gradient_cache(base_config, tmp_path):
    ref_cfg = _full_config(base_config, micro_batch_size=3, output_dir=str(tmp_path / "ref"))
    Trainer(ref_cfg).train()
    cfg = dict(ref_cfg, output_dir=str(tmp_path / "run"))

    def interrupt_at_step_3(trainer, out):
        if trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    assert Trainer(cfg, callbacks=[interrupt_at_step_3]).train()["status"] == "interrupted"
    assert Trainer(cfg).train()["status"] == "completed"
    for name in ("model.safetensors", "prompt.safetensors", "training_state.safetensors"):
        a, b = load_file(str(tmp_path / "run" / "last" / name)), load_file(str(tmp_path / "ref" / "last" / name))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{name}: {k}"


def test_resume_refuses_the_other_mode(base_config):
    cfg = base_config(max_steps=2, eval_steps=100)
    Trainer(cfg).train()
    with pytest.raises(ValueError, match=r"prompt-only \(train_backbone=false\) run .* train_backbone=true"):
        Trainer(dict(cfg, max_steps=4, train_backbone=True)).setup()
    full = _full_config(base_config, output_dir=cfg["output_dir"] + "-full", max_steps=2)
    Trainer(full).train()
    with pytest.raises(ValueError, match=r"full fine-tuning \(train_backbone=true\) run"):
        Trainer(dict(full, max_steps=4, train_backbone=False)).setup()


@pytest.mark.parametrize("change", [dict(prompt_type="input"), dict(prompt_type="both"),
                                    dict(input_prompt_length=3), dict(optiprompt=True), dict(eval_denoise=True),
                                    dict(topk=3), dict(position_mode="shifted")], ids=lambda c: next(iter(c)))
def test_resume_refuses_another_prompt_or_embedding_setup(base_config, change, tmp_path_factory):
    """Each of these keys changes the trained parameters or the evaluated embedding: resuming would keep the
    checkpoint's prompt under the new setting (or fail to load it), so it is refused by name."""
    out = tmp_path_factory.mktemp("run")
    cfg = base_config(max_steps=2, eval_steps=100, pooler="mask", output_dir=str(out))
    Trainer(cfg).train()
    key, value = next(iter(change.items()))
    with pytest.raises(ValueError, match=rf"different configuration \({key}: .* -> {value!r}\)"):
        Trainer(dict(cfg, max_steps=4, **change)).setup()


def test_biases_and_layernorm_weights_are_not_decayed_as_in_hf_trainer(tiny_model_dir):
    """The backbone's groups follow the rule of the Hugging Face Trainer SimCSE and PromptBERT used (transformers
    4.2.1: ``get_parameter_names(model, [nn.LayerNorm])`` minus names containing "bias")."""
    from transformers.trainer_pt_utils import get_parameter_names

    from fastprompt.train.backbone import optimizer_groups
    from fastprompt.train.config import TrainConfig

    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(3), mlp="train").train_backbone()
    cfg = TrainConfig(train_backbone=True, backbone_weight_decay=0.01, weight_decay=0.0)
    rest, decayed, exempt = optimizer_groups(cfg, enc.trainable_parameters(), enc)
    names = {id(p): n for n, p in enc.backbone.named_parameters()}
    hf_decay = {n for n in get_parameter_names(enc.backbone, [torch.nn.LayerNorm]) if "bias" not in n}
    assert {names[id(p)] for p in decayed["params"]} == hf_decay - {n for n in hf_decay if n.startswith("pooler.")}
    assert decayed["weight_decay"] == 0.01 and exempt["weight_decay"] == 0.0
    exempt_names = {names[id(p)] for p in exempt["params"]}
    assert exempt_names and all("bias" in n or "LayerNorm" in n for n in exempt_names)
    assert any(n.endswith("LayerNorm.weight") for n in exempt_names)
    assert {id(p) for p in rest["params"]} == {id(p) for n, p in enc.named_parameters()
                                             if p.requires_grad and not n.startswith("backbone.")}


def test_the_backbones_own_pooler_is_not_trained_and_is_saved_unchanged(base_config, tiny_bert_dir):
    """fastprompt pools the last hidden states itself: the backbone's pooler (dense + tanh) never gets a gradient,
    so it is left out of the trainable set (under several processes the all-reduce would have given it zeros and
    AdamW's weight decay would have shrunk it) and best/ holds it as the base model has it."""
    from transformers import AutoModel

    trainer = Trainer(_full_config(base_config, backbone_weight_decay=0.5, max_steps=3))
    trainer.setup()
    pooler = trainer.encoder.backbone.pooler
    assert not any(p.requires_grad for p in pooler.parameters())
    assert not {id(p) for p in pooler.parameters()} & {id(p) for p in trainer.params}
    assert trainer.encoder.backbone.encoder.layer[0].output.dense.weight.requires_grad
    assert trainer.train()["status"] == "completed"
    base, best = AutoModel.from_pretrained(tiny_bert_dir), AutoModel.from_pretrained(trainer.best_dir)
    for k in ("pooler.dense.weight", "pooler.dense.bias"):
        assert torch.equal(best.state_dict()[k], base.state_dict()[k]), k
    assert not torch.equal(best.state_dict()["encoder.layer.0.output.dense.weight"],
                           base.state_dict()["encoder.layer.0.output.dense.weight"])

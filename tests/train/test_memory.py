"""The up-front activation-memory estimate refuses a batch that cannot fit, suggesting micro_batch_size."""
import sys

import pytest

import fastprompt.train.memory as memory_module
from fastprompt.train import Trainer
from fastprompt.train.memory import GiB, ModelShape, activation_bytes, available_bytes, check_step_memory

MINILM = ModelShape(num_layers=6, hidden_size=384, num_heads=12, prefix_length=12)


def test_estimate_scales_with_the_batch_and_matches_a_measurement():
    one = activation_bytes(MINILM, 1, 32)
    assert activation_bytes(MINILM, 512, 32) == 512 * one
    assert activation_bytes(MINILM, 512, 32, element_size=2) < 0.6 * activation_bytes(MINILM, 512, 32)
    assert activation_bytes(MINILM, 512, 32, gradient_checkpointing=True) < 0.3 * activation_bytes(MINILM, 512, 32)
    # measured on this machine (peak RSS growth of one forward+backward of MiniLM + a 12-token prefix, fp32,
    # docs/troubleshooting.md, "Training runs"): 3.16 GiB for 512 sequences of 32 tokens, 9.60 GiB for 2048
    assert 0.8 < 3.16 * GiB / activation_bytes(MINILM, 512, 32) < 1.25
    assert 0.8 < 9.60 * GiB / activation_bytes(MINILM, 2048, 32) < 1.25


def test_check_refuses_with_a_micro_batch_size_that_fits():
    kw = dict(views=2, max_length=32, element_size=4, gradient_checkpointing=False)
    with pytest.raises(ValueError, match=r"a batch of 16825 rows x 2 views x 32 tokens needs about .* GiB.* more "
                                         r"than the 8.0 GiB available; set micro_batch_size=(\d+)") as info:
        check_step_memory(MINILM, rows=16825, micro_batch_rows=None, available=8 * GiB, **kw)
    suggested = int(info.value.args[0].split("micro_batch_size=")[1].split()[0])
    assert check_step_memory(MINILM, rows=16825, micro_batch_rows=suggested, available=8 * GiB, **kw) <= 8 * GiB
    assert check_step_memory(MINILM, rows=16825, micro_batch_rows=None, available=None, **kw) > 8 * GiB  # unknown


def test_available_memory_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError: /proc/meminfo
    free = available_bytes("cpu")
    assert free is None or free > 0


def test_trainer_refuses_a_huge_batch_before_the_first_step(base_config, monkeypatch):
    monkeypatch.setattr(memory_module, "available_bytes", lambda device: 4 * 1024 ** 2)  # 4 MiB free
    cfg = base_config(batch_size=1000000)
    with pytest.raises(ValueError, match=r"a batch of 96 rows .* more than the 4.0 MiB available; set "
                                         r"micro_batch_size=\d+"):
        Trainer(cfg).train()
    steps = []
    summary = Trainer(dict(cfg, micro_batch_size=8, max_steps=1),
                      callbacks=[lambda t, out: steps.append(out)]).train()  # the suggestion works
    assert summary["status"] == "completed" and len(steps) == 1
    assert Trainer(dict(cfg, check_memory=False, max_steps=1, overwrite_output_dir=True,
                        resume=False)).train()["status"] == "completed"


def test_trained_weights_gradients_and_adamw_moments_are_counted(tiny_bert_dir):
    from fastprompt.model import PromptConfig, PromptEncoder

    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    prompt_only = ModelShape.of(enc)
    assert prompt_only.trained_bytes == 4 * enc.prompt.prefix.numel()
    enc.train_backbone()
    full = ModelShape.of(enc)
    backbone = sum(p.numel() for n, p in enc.backbone.named_parameters() if not n.startswith("pooler."))
    assert full.trained_bytes == 4 * (backbone + enc.prompt.prefix.numel())
    assert full.optimizer_bytes == 12 * (backbone + enc.prompt.prefix.numel())  # fp32 grad + exp_avg + exp_avg_sq
    kw = dict(rows=8, views=2, max_length=16, element_size=4, micro_batch_rows=None, gradient_checkpointing=False)
    activations = check_step_memory(prompt_only, available=None, **kw) - prompt_only.optimizer_bytes
    assert check_step_memory(full, available=None, **kw) == activations + full.optimizer_bytes
    # room for the activations but not for the backbone's optimizer state: refused, naming it
    room = activations + full.optimizer_bytes // 2
    assert check_step_memory(prompt_only, available=room, **kw) <= room
    with pytest.raises(ValueError, match="gradients and AdamW moments"):
        check_step_memory(full, available=room, **kw)
    # the state alone does not fit: no micro-batch size can help, and the message says what can
    with pytest.raises(ValueError, match=r"alone need about .*train_backbone=false"):
        check_step_memory(full, available=full.optimizer_bytes - 1, **kw)


def test_trainer_counts_the_trained_backbone(base_config, monkeypatch):
    """The trainer's estimate sees the backbone's parameters once train_backbone made them trainable."""
    seen = []
    real = memory_module.check_step_memory
    monkeypatch.setattr(memory_module, "check_step_memory",
                        lambda shape, **kw: seen.append(shape) or real(shape, **kw))
    Trainer(base_config(max_steps=1, train_backbone=True)).setup()
    Trainer(base_config(max_steps=1, output_dir=base_config()["output_dir"] + "-prompt")).setup()
    full, prompt = seen
    assert prompt.trained_bytes == 4 * 4 * 2 * 2 * 32  # the tiny BERT's prefix: P x layers x (k, v) x hidden
    assert full.trained_bytes > 50 * prompt.trained_bytes

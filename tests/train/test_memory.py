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

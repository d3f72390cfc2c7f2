"""``auto`` on CUDA for prefix attention (issue 41, item 5): the fused kernels, or the plain path (SDPA on the
concatenated prefix, backend "cpu": the aten composite, which takes every option the kernels take) where this GPU's
tuned table measured the plain path faster at the shape class, and only if it fits in the free memory; decided and
logged once per shape class. Checked on CPU tensors with the GPU's answers (table, free memory, name) stood in."""
import logging

import pytest
import torch
from fastprompt.kernels.tuning import BackendChoice

from fastprompt.ops import attention as attn


@pytest.fixture
def gpu(monkeypatch):
    """The measured choices and free memory a GPU would give; records every table lookup."""
    state = {"choice": None, "free": 80 << 30, "lookups": []}

    def measured_choice(op, key, device):
        state["lookups"].append((op, key))
        return state["choice"]

    monkeypatch.setattr("fastprompt.kernels.tuning.measured_choice", measured_choice)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(attn, "_AUTO_CHOICES", {})
    return state


def _inputs(B=64, S=32, H=12, D=64, P=16, dtype=torch.bfloat16, grad=True):
    q = torch.zeros(B, H, S, D, dtype=dtype, requires_grad=grad)
    k = torch.zeros(B, H, S, D, dtype=dtype)
    pk = torch.zeros(H, P, D, dtype=dtype)
    return q, k, pk


def test_the_plain_path_where_it_was_measured_faster_logged_once(gpu, caplog):
    gpu["choice"] = BackendChoice("prefix_attention", {}, "plain", {"triton": 1.79, "plain": 0.86}, "the kit")
    q, k, pk = _inputs()
    with caplog.at_level(logging.INFO, logger="fastprompt.ops.attention"):
        assert attn._measured_auto(q, k, pk, 0.0, None, None, None) == "cpu"
        assert attn._measured_auto(q, k, pk, 0.0, None, None, None) == "cpu"
    assert len(gpu["lookups"]) == 1 and caplog.text.count("prefix_attention auto on NVIDIA Test GPU") == 1
    op, key = gpu["lookups"][0]
    assert op == "prefix_attention"
    assert key == {"dtype": "bf16", "D": 64, "P": 16, "S": 32, "BH": 768, "grad": True, "dropout": False}
    assert "measured faster" in caplog.text and "1.79" in caplog.text


def test_the_fused_kernels_where_nothing_was_measured_or_the_kernels_won(gpu):
    q, k, pk = _inputs()
    assert attn._measured_auto(q, k, pk, 0.0, None, None, None) == "triton"
    gpu["choice"] = BackendChoice("prefix_attention", {}, "triton", {"triton": 1.0, "plain": 2.0})
    q2, k2, pk2 = _inputs(B=512, S=128)
    assert attn._measured_auto(q2, k2, pk2, 0.1, None, None, None) == "triton"


def test_memory_is_part_of_the_rule(gpu):
    gpu["choice"] = BackendChoice("prefix_attention", {}, "plain", {"triton": 2.0, "plain": 1.0})
    gpu["free"] = 1 << 20  # 1 MiB free: the concatenation would not fit
    q, k, pk = _inputs()
    assert attn._measured_auto(q, k, pk, 0.0, None, None, None) == "triton"


def test_a_packed_batch_is_keyed_by_its_sequences_and_padded_width(gpu):
    q = torch.zeros(1, 12, 100, 64, dtype=torch.float16, requires_grad=False)
    k = torch.zeros(1, 12, 100, 64, dtype=torch.float16)
    pk = torch.zeros(12, 8, 64, dtype=torch.float16)
    cu = torch.tensor([0, 30, 64, 100])
    attn._measured_auto(q, k, pk, 0.0, None, cu, 40)
    assert gpu["lookups"][0][1] == {"dtype": "fp16", "D": 64, "P": 8, "S": 40, "BH": 36, "grad": False,
                                    "dropout": False}


def test_the_plain_path_on_a_gpu_computes_in_the_input_dtype():
    """What was measured against the kernels: SDPA in bf16, not upcast (the CPU composite upcasts half)."""
    assert attn._cpu_compute_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
    assert attn._cpu_compute_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32

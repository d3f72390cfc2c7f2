"""kernels/_common.py: what both Triton kernel modules share, and that they do share it (one cosine epsilon
with the reference and the C++ kernel, one TF32 policy, one bf16 upcast rule, one launch-config type, one
interpreter flag, read by the one backend rule), and that loading them loads no autograd op."""
import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from fastprompt.kernels import _common  # noqa: E402
from fastprompt.kernels import contrastive_loss as cl  # noqa: E402
from fastprompt.kernels import prefix_attention as pa  # noqa: E402

from fastprompt import constants  # noqa: E402
from fastprompt.backends import BackendUnavailableError  # noqa: E402
from fastprompt.ops import _cpp, contrastive, prefix_attention, reference  # noqa: E402


def test_named_constants():
    assert _common.LOG2E.value == math.log2(math.e)
    assert _common.LN2.value == math.log(2.0)
    assert _common.LOG2E.value * _common.LN2.value == pytest.approx(1.0, abs=1e-15)


def test_one_cosine_epsilon_for_reference_triton_and_cpp():
    # the op computes the inverse norms the contrastive-loss kernels take (C++ and Triton alike)
    assert _common.COSINE_EPS is constants.COSINE_EPS and contrastive.COSINE_EPS is constants.COSINE_EPS
    assert reference.COSINE_EPS is constants.COSINE_EPS
    if not _cpp.available():
        pytest.skip("fastprompt._C (the C++ extension) is not built")
    assert torch.ops.fastprompt.cosine_eps() == constants.COSINE_EPS  # csrc/constants.h


def test_kernel_modules_load_no_autograd_op():
    """kernels/ knows nothing of torch.autograd: importing both kernel modules loads no fastprompt.ops module."""
    code = ("import sys, fastprompt.kernels.contrastive_loss, fastprompt.kernels.prefix_attention; "
            "print(sorted(m for m in sys.modules if m.startswith('fastprompt.ops')))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.fixture
def allow_tf32():
    """Sets torch.backends.cuda.matmul.allow_tf32 (a property object: monkeypatch cannot restore it)."""
    before = torch.backends.cuda.matmul.allow_tf32
    yield lambda value: setattr(torch.backends.cuda.matmul, "allow_tf32", value)
    torch.backends.cuda.matmul.allow_tf32 = before


def test_tf32_policy(monkeypatch, allow_tf32):
    """fp32 dots use TF32 exactly when torch allows TF32 matmuls, never in the interpreter; half ignores it."""
    monkeypatch.setattr(_common, "INTERPRETED", False)
    allow_tf32(False)
    assert [_common.dot_precision(dt) for dt in _common.TRITON_TYPE] == ["ieee"] * 3
    allow_tf32(True)
    assert _common.dot_precision(torch.float32) == "tf32"
    assert _common.dot_precision(torch.float16) == _common.dot_precision(torch.bfloat16) == "ieee"
    monkeypatch.setattr(_common, "INTERPRETED", True)
    assert _common.dot_precision(torch.float32) == "ieee"


def test_upcast_rule(monkeypatch):
    """Only bf16 under the interpreter is upcast (the interpreter computes bf16 on the raw bits); fp16 runs the
    kernels' own half-precision path there too, as on a GPU."""
    monkeypatch.setattr(_common, "INTERPRETED", True)
    assert [_common.upcast(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)] == [True, False, False]
    monkeypatch.setattr(_common, "INTERPRETED", False)
    assert not any(_common.upcast(dt) for dt in _common.TRITON_TYPE)


def test_both_kernel_modules_use_the_shared_helpers():
    for module in (cl, pa):
        assert module.dot_precision is _common.dot_precision
        assert module.upcast is _common.upcast
        assert module.interpreting is _common.interpreting
        assert module.TRITON_TYPE is _common.TRITON_TYPE
    assert isinstance(cl.config(torch.float16, interpret=False), _common.LaunchConfig)
    assert isinstance(pa.config("fwd", 32, 16, 64, torch.float16, False), _common.LaunchConfig)


def test_launch_config():
    cfg = _common.LaunchConfig({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8)
    assert cfg.options() == {"num_warps": 8, "num_stages": 2, "maxnreg": 255}
    wider = cfg.with_tiles(BLOCK_N=64, BLOCK_K=16)
    assert wider.tiles == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16} and cfg.tiles["BLOCK_N"] == 32
    assert pa.config("bwd_dkdv", 32, 16, 64, torch.float16, False).tiles.keys() == {"BLOCK_M", "BLOCK_N", "BLOCK_P",
                                                                                    "BLOCK_D"}


def test_the_backend_rule_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    """Where the kernels run is decided once, by the backend rule, before a launch (the launchers trust it)."""
    monkeypatch.setattr(_common, "INTERPRETED", False)
    z = torch.randn(4, 8)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        contrastive.contrastive_loss(z, z, backend="triton")
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        prefix_attention(q, q, q, torch.randn(1, 2, 8), torch.randn(1, 2, 8), backend="triton")


@pytest.mark.skipif(not _common.interpreting(), reason="needs TRITON_INTERPRET=1 at import (tests/conftest.py)")
def test_interpreter_flag_matches_the_kernels():
    assert type(pa._fwd_kernel).__name__ == type(cl._stats_kernel).__name__ == "InterpretedFunction"
    with pytest.raises(ImportError, match="TRITON_INTERPRET changed"):
        _common.check_interpreted(lambda: None)  # a plain function: what a non-interpreted import would see

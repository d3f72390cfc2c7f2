"""fastprompt.backends: the one rule that turns a requested backend into a concrete one, for both fused ops.

CUDA tensors are stood in for by objects with the three attributes the rule reads (device.type, dtype,
shape): no GPU here. The C++ extension, the triton package and the interpreter are switched by monkeypatch.
"""
import logging
from types import SimpleNamespace

import pytest
import torch

import fastprompt.ops  # noqa: F401  (registers the ops)
from fastprompt import backends, choices
from fastprompt.backends import BackendUnavailableError, UnsupportedInputError, resolve_backend
from fastprompt.ops import _cpp


def fake(device="cuda", dtype=torch.float16, shape=(2, 4, 8, 64)):
    return SimpleNamespace(device=SimpleNamespace(type=device), dtype=dtype, shape=shape)


@pytest.fixture
def env(monkeypatch):
    """Set triton installed / interpreter on / C++ built, and forget earlier fallback warnings."""
    monkeypatch.setattr(backends, "_WARNED", set())

    def set_env(triton=True, interpreting=False, cpp=True):
        monkeypatch.setattr(backends, "TRITON_INSTALLED", triton)
        monkeypatch.setattr(backends, "triton_interpreting", lambda: interpreting)
        state = {"tried": True, "module": "built" if cpp else None, "error": None if cpp else ImportError("gone")}
        monkeypatch.setattr(_cpp, "_state", state)

    return set_env


# (op, tensor, triton installed, interpreting, C++ built, requested) -> backend, or the error class
RULE = [
    # auto on CUDA: Triton when it can run and takes the input ...
    ("contrastive_loss", fake(), True, False, True, "auto", "triton"),
    ("prefix_attention", fake(), True, False, True, "auto", "triton"),
    # ... else the op's native path where it runs on CUDA (attention's aten composite), else the reference
    ("contrastive_loss", fake(), False, False, True, "auto", "reference"),
    ("prefix_attention", fake(), False, False, True, "auto", "cpu"),
    ("contrastive_loss", fake(dtype=torch.float64), True, False, True, "auto", "reference"),
    ("prefix_attention", fake(dtype=torch.float64), True, False, True, "auto", "cpu"),
    ("prefix_attention", fake(shape=(2, 4, 8, 160)), True, False, True, "auto", "cpu"),
    ("prefix_attention", fake(), True, True, True, "auto", "cpu"),  # interpreter on: no Triton on CUDA
    # auto on CPU: never the interpreter; the native path when built
    ("contrastive_loss", fake("cpu"), True, True, True, "auto", "cpu"),
    ("prefix_attention", fake("cpu"), True, True, False, "auto", "cpu"),
    ("contrastive_loss", fake("cpu"), True, True, False, "auto", "reference"),
    ("contrastive_loss", fake("mps"), True, False, True, "auto", "reference"),
    # explicit requests
    ("contrastive_loss", fake("cpu"), False, False, False, "reference", "reference"),
    ("prefix_attention", fake(), False, False, False, "reference", "reference"),
    ("contrastive_loss", fake("cpu", torch.float32), True, True, True, "triton", "triton"),
    ("prefix_attention", fake("cpu", torch.bfloat16), True, True, True, "triton", "triton"),
    ("prefix_attention", fake(), True, False, True, "cpu", "cpu"),
    ("contrastive_loss", fake(), True, False, True, "cpu", BackendUnavailableError),
    ("contrastive_loss", fake("cpu"), True, False, False, "cpu", BackendUnavailableError),
    ("prefix_attention", fake("cpu"), False, False, True, "triton", BackendUnavailableError),
    ("contrastive_loss", fake("cpu"), True, False, True, "triton", BackendUnavailableError),
    ("contrastive_loss", fake(), True, True, True, "triton", BackendUnavailableError),
    ("prefix_attention", fake("mps"), True, False, True, "triton", BackendUnavailableError),
    ("contrastive_loss", fake(dtype=torch.float64), True, False, True, "triton", UnsupportedInputError),
    ("prefix_attention", fake(shape=(1, 1, 4, 160)), True, False, True, "triton", UnsupportedInputError),
]


@pytest.mark.parametrize("op,tensor,triton,interpreting,cpp,requested,expected", RULE)
def test_the_rule(env, op, tensor, triton, interpreting, cpp, requested, expected):
    env(triton, interpreting, cpp)
    if isinstance(expected, str):
        assert resolve_backend(op, tensor, requested) == expected
    else:
        with pytest.raises(expected, match=f"{op}: backend='{requested}'"):
            resolve_backend(op, tensor, requested)


def test_errors_are_value_errors_with_the_reason(env):
    assert issubclass(BackendUnavailableError, ValueError) and issubclass(UnsupportedInputError, ValueError)
    env(triton=True, interpreting=False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1"):
        resolve_backend("prefix_attention", fake("cpu"), "triton")
    env(triton=False)
    with pytest.raises(BackendUnavailableError, match="pip install triton"):
        resolve_backend("contrastive_loss", fake(), "triton")
    env(cpp=False)
    with pytest.raises(BackendUnavailableError, match="pip install --no-build-isolation"):
        resolve_backend("contrastive_loss", fake("cpu"), "cpu")
    env()
    with pytest.raises(UnsupportedInputError, match="float16, bfloat16, float32, got float64"):
        resolve_backend("contrastive_loss", fake(dtype=torch.float64), "triton")
    with pytest.raises(ValueError, match="backend must be one of auto, triton, cpu, reference, chunked; got 'cuda'"):
        resolve_backend("contrastive_loss", fake(), "cuda")
    with pytest.raises(ValueError, match="backend must be one of auto, triton, cpu, reference; got 'chunked'"):
        resolve_backend("prefix_attention", fake(), "chunked")  # a variant of the loss only
    with pytest.raises(ValueError, match="unknown op 'softmax'; registered: contrastive_loss, prefix_attention"):
        resolve_backend("softmax", fake(), "auto")


def test_reference_fallback_warns_once_per_op_with_the_reasons(env, caplog):
    env(triton=False, cpp=False)
    with caplog.at_level(logging.WARNING, logger="fastprompt.backends"):
        for _ in range(3):
            assert resolve_backend("contrastive_loss", fake(), "auto") == "reference"
            assert resolve_backend("contrastive_loss", fake("cpu"), "auto") == "reference"
    (record,) = caplog.records
    msg = record.getMessage()
    assert msg.startswith("contrastive_loss falls back to the plain-PyTorch reference")
    assert "Triton: the triton package is not installed" in msg and "runs on cpu tensors, not on cuda" in msg


def test_real_tensors_and_the_interpreter_of_this_test_session():
    """tests/conftest.py turns the interpreter on: CPU tensors may ask for Triton, auto still takes the CPU path."""
    q = torch.zeros(1, 1, 2, 8)
    assert backends.triton_interpreting()
    assert resolve_backend("prefix_attention", q, "triton") == "triton"
    assert resolve_backend("prefix_attention", q, "auto") == "cpu"
    assert resolve_backend(fastprompt.ops.attention.SUPPORT, q, "reference") == "reference"


def test_the_rule_is_not_re_exported_below_it():
    """The rule is a layer under the ops and above fastprompt.choices, whose BACKENDS it reads: choices re-exporting
    it made a circle (scripts/lint_imports.py, tests/test_layers.py keep both out). The old name still resolves,
    at run time only, through the moved-names shim (fastprompt/_moved.py, tests/test_public_api.py)."""
    assert "resolve_backend" not in vars(choices)
    assert backends.BACKENDS is choices.BACKENDS

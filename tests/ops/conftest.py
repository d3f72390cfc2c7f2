"""Fixtures of the C++ CPU kernels' tests: each x86-64 level this CPU supports (``isa``), outputs poisoned before
a kernel writes them (``poisoned``). Both switches are read by csrc/cpu_levels.h, shared by every C++ kernel."""
import pytest

from fastprompt.ops import _cpp, attention_cpu

ISA_LEVELS = attention_cpu.isa_levels() if _cpp.available() else []


@pytest.fixture(params=ISA_LEVELS)
def isa(request, monkeypatch):
    """Each x86-64 level this CPU supports in turn (FASTPROMPT_CPU_ISA): the AVX2 and baseline code a CPU without
    AVX-512 runs is tested here too."""
    monkeypatch.setenv("FASTPROMPT_CPU_ISA", request.param)
    assert attention_cpu.isa() == request.param
    return request.param


@pytest.fixture
def poisoned(monkeypatch):
    """The kernels fill their outputs (and gradients; the dropout + add + LayerNorm op its keep bits with 0xA5) with
    NaN before writing them: an element a kernel forgets shows up."""
    monkeypatch.setenv("FASTPROMPT_CPU_POISON", "1")

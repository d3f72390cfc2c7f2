"""scripts/gpu_check.sh (the GPU validation kit) on a machine without a CUDA GPU: it says so and exits 0, having
written nothing. (On a CUDA machine the kit itself is the check: it runs the tests marked ``cuda``.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the kit would run for real")
def test_gpu_check_exits_cleanly_without_a_gpu():
    results = ROOT / "bench" / "results" / "gpu"
    existed = results.exists()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: no GPU: torch "), proc.stdout
    assert "sees no CUDA GPU" in proc.stdout and "docs/gpu.md" in proc.stdout
    assert results.exists() == existed


def test_cuda_tests_are_collected_and_skipped_with_the_reason():
    """The normal test command collects the CUDA-only tests and skips them, saying why."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA tests run here")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/ops/test_ops_cuda.py", "-k", "deterministic"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "2 skipped" in proc.stdout, proc.stdout[-2000:]
    assert "needs a CUDA GPU" in proc.stdout or "Triton interpreter is on" in proc.stdout

"""CMakeLists.txt builds csrc/ (find_package(Torch)) into a library whose ops give the same results as the
setup.py extension: configure + build in a temporary folder (~60 s), then load it in a fresh Python (the
setup.py-built fastprompt._C would register the same op names) and compare with the reference."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy  # the CMake rebuild of the C++ kernels: ~50 s

ROOT = Path(__file__).resolve().parents[1]

CHECK = textwrap.dedent('''
    import sys, torch
    from fastprompt.ops import _cpp, contrastive_loss
    _cpp.load_library(sys.argv[1])
    g = torch.Generator().manual_seed(0)
    zs = [torch.randn(n, 24, generator=g, dtype=torch.float64).requires_grad_() for n in (40, 90, 90)]
    kw = dict(positive_offset=25, hinge_weight=10.0, hard_negative_weight=0.3, symmetric=True)
    out = contrastive_loss(*zs, backend="cpu", **kw)
    ref = contrastive_loss(*zs, backend="reference", **kw)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    for a, b in zip(torch.autograd.grad(out, zs), torch.autograd.grad(ref, zs)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert "fastprompt._C" not in sys.modules
    from fastprompt.constants import COSINE_EPS
    assert torch.ops.fastprompt.cosine_eps() == COSINE_EPS
    print("cmake build ok")
''')


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")
def test_cmake_build_matches_reference(tmp_path):
    import torch.utils

    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
                   check=True, capture_output=True, text=True)
    proc = subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lib = build / "libfastprompt_ops.so"
    assert lib.is_file()
    (tmp_path / "check.py").write_text(CHECK)
    proc = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(lib)], capture_output=True, text=True,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cmake build ok" in proc.stdout

"""Packaging: the source distribution holds what building the C++ extension needs, and building never pulls torch
into pip's isolated build environment (there it would be PyPI's newest, multi-GB CUDA torch, and an extension
compiled against it need not load with the torch actually installed)."""
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_torch_is_not_a_build_requirement():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if r.split("<")[0].split(">")[0].split("=")[0].strip() == "torch"]


def test_sdist_holds_the_extension_sources_kernels_and_build_files(tmp_path):
    pytest.importorskip("build", reason="the `build` package is not installed")
    done = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (sdist,) = tmp_path.glob("fastprompt-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    expected = {"setup.py", "pyproject.toml", "MANIFEST.in", "CMakeLists.txt", "README.md"}
    for pattern in ("csrc/*", "kernels/*.py", "configs/*.yaml", "fastprompt/**/*.py"):
        expected |= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)
                     if p.is_file() and "__pycache__" not in p.parts}
    assert any(n.startswith("csrc/") for n in expected) and "fastprompt/integrations/cli.py" in expected
    assert not expected - names, f"missing from the sdist: {sorted(expected - names)}"
    assert not [n for n in names if n.endswith((".so", ".pyc")) or n.startswith((".venv/", "build/", "tests/"))]

"""Packaging: the source distribution holds what building the C++ extension needs, and building never pulls torch
into pip's isolated build environment (there it would be PyPI's newest, multi-GB CUDA torch, and an extension
compiled against it need not load with the torch actually installed)."""
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: what building needs (the sdist's top level, see MANIFEST.in); tests, benchmarks and build outputs stay behind
SOURCES = ("fastprompt", "kernels", "csrc", "configs", "docs", "setup.py", "pyproject.toml", "MANIFEST.in",
           "README.md", "CMakeLists.txt")


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
    for pattern in ("csrc/*", "kernels/*.py", "kernels/configs/*.json", "configs/*.yaml", "fastprompt/**/*.py"):
        expected |= {p.relative_to(ROOT).as_posix() for p in ROOT.glob(pattern)
                     if p.is_file() and "__pycache__" not in p.parts}
    assert any(n.startswith("csrc/") for n in expected) and "fastprompt/cli/train.py" in expected
    assert not expected - names, f"missing from the sdist: {sorted(expected - names)}"
    assert not [n for n in names if n.endswith((".so", ".pyc")) or n.startswith((".venv/", "build/", "tests/"))]


@pytest.mark.slow
def test_plain_pip_wheel_in_a_fresh_venv_is_pure_python_and_fetches_no_torch(tmp_path):
    """`pip wheel --no-deps .` in a new virtual environment (nothing installed: pip's isolated build fetches the
    build requirements) gives fastprompt-*-py3-none-any.whl without the extension, and the verbose build log shows
    torch neither fetched nor importable in the build environment."""
    src = tmp_path / "src"
    for name in SOURCES:  # a clean copy: no compiled _C, build/ or egg-info of the development checkout
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "wheel", "--no-deps", "-v", ".", "-w",
                           str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    if done.returncode != 0 and "No matching distribution found for setuptools" in log:
        pytest.skip("no package index reachable for pip's isolated build requirements (setuptools)")
    assert done.returncode == 0, log[-3000:]
    fetched = re.findall(r"(?im)^\s*(?:collecting|downloading|processing|using cached|obtaining)\s+(\S+)", log)
    assert fetched and not [f for f in fetched if re.search(r"torch|nvidia|triton|cuda", f, re.I)], fetched
    assert "torch is not importable in the build environment" in log  # setup.py's notice: no torch to build with
    (wheel,) = (tmp_path / "dist").glob("fastprompt-*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "fastprompt/cli/train.py" in names and "fastprompt/kernels/__init__.py" in names
    assert [n for n in names if n.startswith("fastprompt/kernels/configs/") and n.endswith(".json")]  # tuned tables
    assert not [n for n in names if n.endswith((".so", ".pyd", ".pyc"))]

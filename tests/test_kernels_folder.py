"""The top-level kernels/ folder (installed as fastprompt.kernels) never stands in for Hugging Face's ``kernels``
package when Python runs from the checkout's root, as the README's commands do: with ``kernels`` installed (transformers
imports it then), ``import kernels`` there gave this folder, and even ``AutoModel.from_pretrained`` failed with
``cannot import name 'CUDAProperties' from 'kernels'`` (issue 40, item 20; reproduced with kernels 0.18.3)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:  # after the checkout (the current folder comes first on sys.path)
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_an_installed_kernels_package_wins_from_the_checkout_root(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the installed kernels package'\n")
    proc = _run("import kernels, fastprompt.kernels.tuning as t; print(kernels.CUDAProperties, kernels.__file__); "
                "print(t.__name__)", site)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first == f"the installed kernels package {site / 'kernels' / '__init__.py'}"
    assert second == "fastprompt.kernels.tuning"  # the folder itself still serves fastprompt.kernels


def test_without_one_the_top_level_name_is_an_empty_namespace_from_the_checkout_root():
    """As a folder without __init__.py would be: no file, no contents, no submodules; transformers reads that as
    'not installed' (its availability check imports the name when no distribution metadata is found)."""
    proc = _run("import kernels; print(getattr(kernels, '__file__', None), list(kernels.__path__), "
                "[n for n in vars(kernels) if not n.startswith('_')])\n"
                "from transformers.utils.import_utils import is_kernels_available; print(is_kernels_available())")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["None [] []", "False"]
    proc = _run("import kernels.prefix_attention")
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr
    proc = _run("import fastprompt.kernels.prefix_attention as pa; print(pa.__name__)")
    assert proc.returncode == 0 and proc.stdout.strip() == "fastprompt.kernels.prefix_attention", proc.stderr

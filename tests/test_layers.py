"""The import layering (pyproject.toml's [tool.importlinter] contracts, checked by scripts/lint_imports.py, which
scripts/test.sh runs beside ruff): it holds for the package, and it catches an upward import and a cycle inserted
into a copy of it."""
from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (Path(sys.executable).parent / "lint-imports").exists(),
                                reason="import-linter is not installed (scripts/setup.sh installs it)")
_spec = importlib.util.spec_from_file_location("lint_imports", ROOT / "scripts" / "lint_imports.py")
lint = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lint)


def test_the_package_keeps_its_layers_and_has_no_cycles():
    res = lint.lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 kept, 0 broken" in res.stdout
    assert "ignore_imports" not in (ROOT / "pyproject.toml").read_text(encoding="utf-8"), \
        "the contracts exempt no import: fix the import instead"


@pytest.fixture
def checkout(tmp_path):
    """A checkout's layout (fastprompt/, kernels/, pyproject.toml) with copies of this one's sources."""
    skip = shutil.ignore_patterns("__pycache__", "*.so", "kernels")
    shutil.copytree(ROOT / "fastprompt", tmp_path / "fastprompt", ignore=skip)
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@pytest.mark.parametrize("module, line, broken", [
    # the model reaching up into the command line (what fastprompt/cli.py's helpers once invited)
    ("fastprompt/model/pooling.py", "from fastprompt.cli import main", "fastprompt.model.pooling -> fastprompt.cli"),
    # the ops reaching up into the model
    ("fastprompt/ops/attention.py", "import fastprompt.model.encoder",
     "fastprompt.ops.attention -> fastprompt.model.encoder"),
    # a Triton kernel reaching up into the autograd ops that wrap it
    ("kernels/_common.py", "import fastprompt.ops", "fastprompt.kernels._common -> fastprompt.ops"),
    # a shared objective reaching up into a method that builds on it
    ("fastprompt/objectives/base.py", "import fastprompt.methods.crtd",
     "fastprompt.objectives.base -> fastprompt.methods.crtd"),
    # the backend rule reaching up into the ops that register with it (what op_support once did)
    ("fastprompt/backends.py", "import fastprompt.ops", "fastprompt.backends -> fastprompt.ops"),
    # the choices re-exporting the rule that reads them (a circle)
    ("fastprompt/choices.py", "import fastprompt.backends", "fastprompt.choices -> fastprompt.backends"),
    # a cycle inside a package: checkpoints.py imports config.py; config.py importing checkpoints.py closes it
    ("fastprompt/train/config.py", "import fastprompt.train.checkpoints", "No cycles are allowed in fastprompt.train"),
    # the plain readers reaching up into the dispatcher that picks among them (train_files.py imports corpus.py)
    ("fastprompt/data/corpus.py", "import fastprompt.data.train_files", "No cycles are allowed in fastprompt.data"),
], ids=["model->cli", "ops->model", "kernels->ops", "objectives->methods", "backends->ops", "choices->backends",
        "cycle", "reader->dispatcher"])
def test_an_inserted_upward_import_or_cycle_breaks_a_contract(checkout, module, line, broken):
    path = checkout / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}  # noqa\n", encoding="utf-8")
    res = lint.lint_imports(checkout)
    assert res.returncode != 0, res.stdout
    assert " 0 broken" not in res.stdout and broken in res.stdout, res.stdout

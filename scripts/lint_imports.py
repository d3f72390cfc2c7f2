"""Check the import layering: import-linter's ``lint-imports`` with pyproject.toml's [tool.importlinter] contracts,
on the package as it is installed.

setup.py installs ``kernels/`` as ``fastprompt.kernels`` (package_dir), which a checkout holds as two folders, and
import-linter reads the package from the file system: this builds the installed layout from links in a temporary
folder (``fastprompt/*`` and ``fastprompt/kernels``) and runs the linter there. scripts/test.sh runs it beside
ruff; docs/development.md#layers says what the contracts are.

    python scripts/lint_imports.py                  # exit status 0 when every contract is kept
    python scripts/lint_imports.py --source DIR     # the package of another checkout (tests/test_layers.py)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(source: Path = ROOT, *args: str) -> subprocess.CompletedProcess:
    """Run lint-imports on ``source``'s fastprompt/ and kernels/ with ``source``'s pyproject.toml."""
    source = Path(source).resolve()
    linter = Path(sys.executable).parent / "lint-imports"
    with tempfile.TemporaryDirectory(prefix="fastprompt-lint-imports-") as tmp:
        package = Path(tmp) / "fastprompt"
        package.mkdir()
        for entry in (source / "fastprompt").iterdir():
            if entry.name not in ("__pycache__", "kernels"):
                (package / entry.name).symlink_to(entry)
        (package / "kernels").symlink_to(source / "kernels")
        env = {**os.environ, "PYTHONPATH": tmp}
        return subprocess.run([str(linter), "--config", str(source / "pyproject.toml"), "--no-cache", *args],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=ROOT, help="the checkout whose package is checked (this one)")
    args, rest = p.parse_known_args(argv)
    res = lint_imports(args.source, *rest)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())

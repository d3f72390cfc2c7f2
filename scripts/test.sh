#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), lints (ruff, and lint-imports: the layering contracts in pyproject.toml)
# and runs the test suite.
# Tests marked `slow` (the full seven-task STS table of the real model, the exhaustive AOT compile of every
# kernel specialisation, ...) are left out by default to keep CI short; run them with:
#   bash scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (seconds): pycodestyle, pyflakes, import order, bugbear; the rules are in pyproject.toml
.venv/bin/ruff check .
# the import layering and no import cycles: import-linter's contracts ([tool.importlinter] in pyproject.toml)
.venv/bin/python scripts/lint_imports.py
if [ "$#" -eq 0 ]; then
    set -- -m "not slow"
fi
exec .venv/bin/python -m pytest -q "$@"

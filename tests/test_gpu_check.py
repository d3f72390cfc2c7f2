"""scripts/gpu_check.sh (the GPU validation kit): on a machine without a CUDA GPU it says so and exits 0, having
written nothing; with one (here an interpreter that pretends, and records what it is asked to run) it runs the CUDA
tests and every benchmark with --device cuda, the training step over its full grid, and writes their results as
bench/results/*_cuda.csv with a summary. (On a CUDA machine the kit itself is the check.)"""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the kit would run for real")
def test_gpu_check_exits_cleanly_without_a_gpu():
    results = ROOT / "bench" / "results"
    before = sorted(results.rglob("*"))
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpu_check: no GPU: torch "), proc.stdout
    assert "sees no CUDA GPU" in proc.stdout and "docs/gpu.md" in proc.stdout
    assert sorted(results.rglob("*")) == before  # nothing written


# An interpreter for the kit that answers its GPU probe with a GPU, records every other command, and writes the
# CSV a bench is given with --out (one failing bench, if FAIL names it, exits 1 after writing a partial CSV).
FAKE_PYTHON = textwrap.dedent("""\
    #!/usr/bin/env bash
    if [ "$1" = - ]; then
        src=$(cat)
        case "$src" in *get_device_name*) echo "Fake GPU"; exit 0;; esac
        exec "$REAL_PYTHON" - "${@:2}" <<< "$src"
    fi
    echo "$*" >> "$CALLS"
    if [ "$1" = -c ]; then echo "torch CUDA 12"; exit 0; fi
    prev=
    for a in "$@"; do
        if [ "$prev" = --out ]; then printf 'bench,device,provider,median_ms\\nx,cuda,p,1.5\\n' > "$a"; fi
        prev=$a
    done
    case "$*" in *"$FAIL"*) exit 1;; esac
""")


def _fake_kit(tmp_path, fail=""):
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_check.sh", root / "scripts")
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHON=str(fake), REAL_PYTHON=sys.executable,
                                                CALLS=str(calls), FAIL=fail or "no-such-command"))
    return proc, calls.read_text().splitlines(), root / "bench" / "results"


def test_gpu_check_runs_every_bench_on_cuda_into_bench_results(tmp_path):
    proc, ran, results = _fake_kit(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ran[0].startswith("-m pytest -q -p no:cacheprovider -m cuda tests/ops/test_ops_cuda.py --junitxml "
                             "bench/results/gpu_check_cuda.xml")
    benches = {line.split()[0]: line for line in ran if line.startswith("bench/")}
    assert set(benches) == {"bench/bench_prefix_attention.py", "bench/bench_contrastive_loss.py",
                            "bench/bench_mlm_logits.py", "bench/bench_train_step.py"}
    assert all("--device cuda" in line for line in ran if line.startswith("bench/"))
    assert benches["bench/bench_train_step.py"].endswith(
        "--batches 64,256,1024 --seq 32,128 --out bench/results/train_step_cuda.csv")
    names = ["prefix_attention_bf16", "prefix_attention_fp32", "contrastive_loss", "mlm_logits", "train_step"]
    assert sorted(p.name for p in results.glob("*_cuda.csv")) == sorted(f"{n}_cuda.csv" for n in names)
    summary = (results / "gpu_check_cuda.md").read_text()
    assert summary.startswith("# GPU check: Fake GPU") and summary.rstrip().endswith("Everything passed.")
    assert all(f"## {n}_cuda.csv" in summary for n in names) and "| provider | median_ms |" in summary
    assert (results / "gpu_check_logs" / "train_step.log").is_file()


def test_gpu_check_reports_a_failing_bench_and_keeps_going(tmp_path):
    proc, ran, results = _fake_kit(tmp_path, fail="bench_mlm_logits.py")
    assert proc.returncode == 1 and "gpu_check: FAILED: mlm_logits" in proc.stdout
    assert any(line.startswith("bench/bench_train_step.py") for line in ran)  # the benches after it still ran
    summary = (results / "gpu_check_cuda.md").read_text()
    assert "## mlm_logits_cuda.csv" not in summary and "## train_step_cuda.csv" in summary
    assert "FAILED: mlm_logits (see bench/results/gpu_check_logs/)" in summary


def test_cuda_tests_are_collected_and_skipped_with_the_reason():
    """The normal test command collects the CUDA-only tests and skips them, saying why."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CUDA tests run here")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/ops/test_ops_cuda.py", "-k", "deterministic"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "2 skipped" in proc.stdout, proc.stdout[-2000:]
    assert "needs a CUDA GPU" in proc.stdout or "Triton interpreter is on" in proc.stdout

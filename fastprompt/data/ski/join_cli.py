"""``fastprompt join-ski``: the SKI of NLI premises joined onto the NLI rows (:func:`~fastprompt.data.ski.join_ski`)."""
from __future__ import annotations

import argparse

EPILOG = """\
examples:
  fastprompt generate-ski --input data/nli_for_simcse.csv --column sent0 --output data/nli-ski.csv
  fastprompt join-ski --nli data/nli_for_simcse.csv --ski data/nli-ski.csv --output data/nli-ski-triplets.csv
  fastprompt train --config configs/skicse-sup-bert-base.yaml --set train_file=data/nli-ski-triplets.csv

Every NLI row whose sent0 has a SKI is written with a ski column appended (sent0,sent1,hard_neg -> sent0,sent1,
hard_neg,ski; sent0,sent1 -> sent0,sent1,ski); rows without a SKI are left out and counted.
"""


def add_join_ski_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "join-ski", help="append the SKI of each NLI premise to the NLI rows: supervised SKICSE's training file",
        description="Join a generate-ski output (sent0,ski) onto an NLI file (sent0,sent1[,hard_neg]) by the "
                    "premise sent0, and write the rows that have a SKI as a CSV for objective=skicse.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nli", required=True, metavar="FILE",
                   help="NLI rows: a CSV with the header sent0,sent1[,hard_neg]")
    p.add_argument("--ski", required=True, metavar="FILE",
                   help="the SKI of the premises: a sent0,ski CSV written by fastprompt generate-ski")
    p.add_argument("--output", required=True, metavar="FILE.csv", help="the joined rows (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.set_defaults(func=run_join_ski)
    return p


def run_join_ski(args: argparse.Namespace) -> int:
    from fastprompt.data.ski.files import join_ski, write_examples_csv
    from fastprompt.io import check_apart, check_output_file

    out = check_output_file(args.output, "--output")
    check_apart(out, (args.nli, args.ski))
    if out.exists() and not args.overwrite:
        raise ValueError(f"--output {args.output} exists; pass --overwrite to replace it")
    joined = join_ski(args.nli, args.ski)
    write_examples_csv(joined, out)
    total = len(joined) + joined.skipped["rows without SKI"]
    print(f"wrote {len(joined)} of {total} NLI rows with their SKI to {out} ({','.join(joined.columns)}); "
          f"{joined.skipped['rows without SKI']} NLI row(s) had no SKI and were left out")
    other = {k: v for k, v in joined.skipped.items() if v and k != "rows without SKI"}
    if other:
        print("skipped in the NLI file: " + ", ".join(f"{v} {k}" for k, v in other.items()))
    return 0

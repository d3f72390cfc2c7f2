"""Write the measured tables of docs/dropin.md from the committed results of bench_st_loss.py and
bench_peft_prefix.py (bench/results/*.json: the rows and the command that produced them).

Each table replaces the text between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in the document, so the
docs show exactly what the CSVs hold:

    python bench/dropin_tables.py                 # rewrites docs/dropin.md in place
    python bench/dropin_tables.py --check         # exit 1 if docs/dropin.md is not what the results give
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "dropin.md"
ST_LOSS = ("st_loss_cpu_loss.json", "st_loss_cpu_loss_4096x3.json")
ST_STEP = ("st_loss_cpu_step.json",)
PEFT = ("peft_prefix_cpu.json", "peft_prefix_cpu_projection.json")
ST_NAMES = {"fastprompt": "fastprompt MNRL", "mnrl": "sentence-transformers MNRL",
            "cached_mnrl": "sentence-transformers CachedMNRL (mini-batch 32)",
            "fastprompt_cached": "fastprompt CachedMNRL (mini-batch 32)"}
PEFT_NAMES = {"peft": "PEFT", "fastprompt": "`accelerate_peft`",
              "fastprompt_ckpt": "`accelerate_peft` + gradient checkpointing"}


def _load(names) -> tuple[list[dict], list[str], dict]:
    rows, commands, versions = [], [], {}
    for name in names:
        path = RESULTS / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        rows += data["rows"]
        commands.append(data["command"])
        versions.update(data.get("versions", {}))
    return rows, commands, versions


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}" if seconds < 10 else f"{seconds * 1e3:,.0f}"


def _footer(commands, versions) -> list[str]:
    pinned = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if v)
    return ["", f"Measured with {pinned},", "one torch thread per process, on 2 CPU cores shared with other jobs "
            "(ratios come from providers timed", "alternately in one process). Reproduce, then rewrite this table "
            "with `python bench/dropin_tables.py`:", "", "```bash", *commands, "```"]


def st_table(names, title_part: str) -> str:
    rows, commands, versions = _load(names)
    if not rows:
        return "(not measured)"
    rows.sort(key=lambda r: (r["columns"], r["batch"], list(ST_NAMES).index(r["provider"])))
    lines = [f"| batch | columns | {title_part} | ms / step | time × MNRL | peak extra MB | memory × MNRL |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']:,} | {r['columns']} | {ST_NAMES[r['provider']]} | {_ms(r['median_s'])} | "
                     f"{r['time_vs_mnrl']:.2f} | {r['peak_extra_mb']:,.1f} | {r['mem_vs_mnrl']:.2f} |")
    return "\n".join(lines + _footer(commands, versions))


def peft_table() -> str:
    rows, commands, versions = _load(PEFT)
    if not rows:
        return "(not measured)"
    rows.sort(key=lambda r: (r["projection"], r["batch"], list(PEFT_NAMES).index(r["provider"])))
    lines = ["| batch | prefix_projection | provider | ms / step | time × PEFT | peak extra MB | memory × PEFT |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']:,} | {'on' if r['projection'] else 'off'} | {PEFT_NAMES[r['provider']]} | "
                     f"{_ms(r['median_s'])} | {r['time_vs_peft']:.2f} | {r['peak_extra_mb']:,.1f} | "
                     f"{r['mem_vs_peft']:.2f} |")
    return "\n".join(lines + _footer(commands, versions))


def render(text: str) -> str:
    tables = {"st_loss": st_table(ST_LOSS, "loss"), "st_step": st_table(ST_STEP, "loss"), "peft": peft_table()}
    for name, table in tables.items():
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC} has no <!-- table:{name} --> ... <!-- /table:{name} --> block")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the document differs from the results")
    args = p.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python bench/dropin_tables.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        tmp = DOC.with_name(f".{DOC.name}.tmp")
        tmp.write_text(new, encoding="utf-8")
        os.replace(tmp, DOC)  # atomic: a crash leaves the old document
    return 0


if __name__ == "__main__":
    sys.exit(main())

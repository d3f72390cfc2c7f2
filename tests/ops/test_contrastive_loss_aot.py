"""Ahead-of-time compilation of the contrastive-loss Triton kernels for sm_80 and sm_90 (no GPU needed):
zero register spills and shared memory within the per-block limit (232448 B on sm_90, 166912 B on sm_80).

CI compiles the representative subset of ``aot_specs()`` (the register-heaviest variant of each kernel for
fp16 and fp32); the slow test (and ``python -m fastprompt.kernels.aot fastprompt.kernels.contrastive_loss
--cc 80 90 --full``) compiles every specialisation the launchers can produce.
"""

import pytest
import torch

pytest.importorskip("triton")

from fastprompt.kernels import aot  # noqa: E402
from fastprompt.kernels import contrastive_loss as tk  # noqa: E402

MODULE = "fastprompt.kernels.contrastive_loss"
FLAGS = ("NSEG", "SEG", "DPAD")


def assert_all_fit(rows, specs):
    assert len(rows) == 2 * len(specs)
    assert {r.cc for r in rows} == {80, 90}
    assert {r.name for r in rows} == {s.name for s in specs}
    bad = [r for r in rows if not r.fits]
    assert not bad, "kernels that spill or exceed shared memory:\n" + aot.format_table(bad)
    assert all(r.n_regs > 0 and r.shared > 0 and r.shared <= aot.SHARED_MEM_LIMIT[r.cc] for r in rows)


def test_ci_specialisations_fit_sm80_and_sm90():
    assert_all_fit(aot.check_module(MODULE, ccs=(80, 90)), tk.aot_specs())


@pytest.mark.slow
def test_every_specialisation_fits_sm80_and_sm90():
    assert_all_fit(aot.check_module(MODULE, ccs=(80, 90), full=True), tk.aot_specs(full=True))


class _Recorder:
    """Stands in for a kernel: records the flag constexprs of each launch, then runs the real kernel."""

    def __init__(self, name, kernel, launches):
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.add((self.name, tuple(sorted((k, v) for k, v in kwargs.items() if k in FLAGS))))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.skipif(not tk.interpreting(), reason="records launches through the interpreter")
def test_spec_list_covers_every_launch_configuration(monkeypatch):
    """Every (kernel, flags) the launchers produce, for every dtype / dot precision, has a full spec with
    the launch configuration the CUDA path uses (up to 8 Matryoshka dimensions: DPAD 1 or 8)."""
    names = ("_stats_kernel", "_bwd_rows_kernel", "_bwd_cols_kernel")
    fn_name = {id(getattr(tk, n)): n for n in names}
    specs = {(fn_name[id(s.fn)], s.constexprs["UPCAST"], s.constexprs["DOT_PREC"],
              tuple(sorted((k, v) for k, v in s.constexprs.items() if k in FLAGS)),
              tuple(sorted((k, v) for k, v in s.constexprs.items() if k.startswith("BLOCK_"))),
              s.num_warps, s.num_stages, s.maxnreg, "stride_x" in s.divisible_by_16)
             for s in tk.aot_specs(full=True)}
    launches = set()
    for name in names:
        monkeypatch.setattr(tk, name, _Recorder(name, getattr(tk, name), launches))
    g = torch.Generator().manual_seed(0)
    for nseg in (1, 2):
        for dims in ([4], [2, 4], [1, 2, 3, 4]):
            x, *cols = (torch.randn(3, 4, generator=g) for _ in range(1 + nseg))
            r = [torch.stack([1 / z[:, :t].norm(dim=1) for t in dims]) for z in [x, *cols]]
            problem = (x, r[0], cols, r[1:], dims, None, [None] * nseg, None, [None] * nseg, None, 0, 10.0, 0.0, 0.0,
                       0.0)
            st = tk.stats(*problem, True)
            tk.grads(*problem, st[0], *(torch.ones(len(dims), 3) for _ in range(3)), st[3])
    assert len(launches) == 4 + 4 + 4  # (segments or segment) x DPAD for each kernel
    for dtype, precs in ((torch.float16, ["ieee"]), (torch.bfloat16, ["ieee"]), (torch.float32, ["ieee", "tf32"])):
        cfg = tk.config(dtype, interpret=False)
        blocks = tuple(sorted(cfg.tiles.items()))
        for prec in precs:
            for name, flags in launches:
                for strided in (True, False):
                    # UPCAST is off on a GPU for every dtype (kernels/_common.upcast: bf16 in the interpreter only)
                    key = (name, False, prec, flags, blocks, cfg.num_warps, cfg.num_stages, cfg.maxnreg, strided)
                    assert key in specs, key
    assert {s.name for s in tk.aot_specs()} <= {s.name for s in tk.aot_specs(full=True)}

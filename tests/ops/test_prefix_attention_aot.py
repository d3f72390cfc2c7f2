"""Ahead-of-time compilation of the prefix-attention kernels for sm_80 and sm_90 (no GPU needed): no
register spills, shared memory within the device limit, and the tensor-core instruction each specialisation
runs on (half precision: ``wgmma`` on sm_90, ``mma.sync`` on sm_80). Also checks ``kernels/aot.py`` itself on
toy kernels (a spill must be detected) and that the specialisation list covers every launch configuration.

CI compiles the representative subset of ``aot_specs()`` (see its docstring: the heaviest tiles per dtype
and head dim, with every feature switch on and off, plus the benchmark's shape); the whole list is the slow
test below, or ``python -m fastprompt.kernels.aot fastprompt.kernels.prefix_attention --cc 80 90 --full``.
"""
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from fastprompt.kernels import aot
from fastprompt.kernels import prefix_attention as kernels


@pytest.mark.heavy  # AOT compiles: ~20 s
def test_ci_specialisations_fit_sm80_and_sm90_on_tensor_cores():
    specs = kernels.aot_specs()
    rows = aot.check_module("fastprompt.kernels.prefix_attention", ccs=(80, 90))
    assert len(rows) == 2 * len(specs)
    assert {r.cc for r in rows} == {80, 90}
    assert {r.name for r in rows} == {s.name for s in specs}
    bad = [r for r in rows if not r.fits]
    assert not bad, "kernels that spill or exceed shared memory:\n" + aot.format_table(bad)
    assert all(r.n_regs > 0 and r.shared > 0 for r in rows)
    # half precision on tensor cores: Hopper's warpgroup MMA on sm_90, mma.sync on sm_80; exact fp32 on FMA units
    half = [r for r in rows if "_fp16_" in r.name or "_bf16_" in r.name]
    assert half and all(r.mma == {90: "wgmma", 80: "mma"}[r.cc] for r in half), aot.format_table(half)
    assert all(r.mma == "none" for r in rows if "_fp32_" in r.name and "_tf32_" not in r.name)


@pytest.mark.slow
def test_every_specialisation_fits_sm80_and_sm90():
    """The exhaustive list: every kernel the launchers can compile, on both devices (about 2 CPU-seconds each:
    hours on 2 cores)."""
    rows = aot.check_module("fastprompt.kernels.prefix_attention", ccs=(80, 90), full=True, timeout=12 * 3600)
    assert len(rows) == 2 * len(kernels.aot_specs(full=True))
    bad = [r for r in rows if not r.fits]
    assert not bad, "kernels that spill or exceed shared memory:\n" + aot.format_table(bad)
    half = [r for r in rows if "_fp16_" in r.name or "_bf16_" in r.name or "_tf32_" in r.name]
    assert all(r.mma == {90: "wgmma", 80: "mma"}[r.cc] for r in half), aot.format_table(half)


LAYOUT_FLAGS = ("VARLEN", "HAS_MASK", "HAS_PIDX")


def test_spec_list_covers_every_launch_configuration():
    """Every (kernel, dtype, bias dtype, constexprs, warps, stages) the launchers can produce is in
    aot_specs(full=True), and the CI subset is part of it: each feature switch (token window, attention bias in the
    input dtype or float32, its gradient) over every shape in the padded layout, and the heaviest (every switch on)
    in every batch layout (packed or padded, a padding mask or none, a prompt index or none: they change only index
    loads, so the other switch combinations are compiled in the usual layout). The group size of grouped-query
    heads and the window's width are runtime values the kernels do not specialise on."""
    kernel_of = {id(fn): name for name, fn in kernels._KERNEL_FNS.items()}

    def key(kernel, q_ty, bias_ty, consts, opts, layout=True):
        consts = {k: v for k, v in consts.items() if layout or k not in LAYOUT_FLAGS}
        return (kernel, q_ty, bias_ty, tuple(sorted(consts.items())), opts["num_warps"], opts["num_stages"],
                opts["maxnreg"])

    specs = kernels.aot_specs(full=True)
    full, full_any_layout = set(), set()
    for s in specs:
        args = (kernel_of[id(s.fn)], s.signature["Q"], s.signature.get("BIAS"), s.constexprs,
                dict(num_warps=s.num_warps, num_stages=s.num_stages, maxnreg=s.maxnreg))
        full.add(key(*args))
        full_any_layout.add(key(*args, layout=False))
    launched = 0
    switches = [(False, False, False), (True, False, False), (False, True, False), (True, True, False),
                (False, True, True), (True, True, True)]
    for dtype, ty, precs in ((torch.float16, "*fp16", ["ieee"]), (torch.bfloat16, "*bf16", ["ieee"]),
                             (torch.float32, "*fp32", ["ieee", "tf32"])):  # tf32: torch allows TF32 matmuls
        for S, P, D, dropout, prec, (masked, bias, grad), bias_ty in itertools.product(
                (1, 17, 32, 33, 128, 512), (0, 1, 16, 17, 64), (8, 32, 48, 64, 100, 128), (False, True), precs,
                switches, (ty, "*fp32")):
            # every layout with every switch on, the usual one otherwise (its other layouts: the projection)
            for kernel, layout in itertools.product(kernels.KERNELS, kernels.LAYOUTS if masked and bias and grad
                                                    else kernels.LAYOUTS[:1]):
                consts, opts = kernels._constexprs(kernel, S, P, D, dtype, dropout, upcast=False, dot_prec=prec,
                                                   masked=masked, bias=bias, bias_grad=grad, varlen=layout[0],
                                                   has_mask=layout[1], has_pidx=layout[2])
                # the BIAS pointer is q itself when there is no bias
                args = (kernel, ty, bias_ty if consts.get("HAS_BIAS") else ty, consts, opts)
                grad = grad and kernel == "bwd_dq"  # the other kernels take no BIAS_GRAD switch
                heaviest = (masked, bias, grad, bias_ty[1:]) == kernels._feature_variants(kernel, ty[1:])[-1]
                if heaviest:
                    assert key(*args) in full, args
                else:
                    assert key(*args, layout=False) in full_any_layout, args
                launched += 1
    assert launched
    names = {s.name for s in specs}
    assert {s.name for s in kernels.aot_specs()} <= names
    assert len(names) == len(specs)


def test_no_specialisation_on_group_size_window_width_or_batch_chunks():
    """The query heads per key/value head, the window bounds, the prompt count and the prefix gradient's batch
    chunks are runtime integers: Triton would otherwise compile another kernel for each value equal to 1."""
    runtime_values = {"group", "win_left", "win_right", "T", "B", "n_chunks", "chunk"}
    for name, fn in kernels._KERNEL_FNS.items():
        runtime = runtime_values & set(kernels._signature(name, "fp16"))
        # a JITFunction, or the interpreter's stand-in (which keeps the decorator's arguments)
        listed = fn.kwargs["do_not_specialize"] if hasattr(fn, "kwargs") else fn.do_not_specialize
        assert runtime and runtime <= set(listed), name


def test_tune_space_candidates_build_aot_specs():
    """A tuner filters its candidates by the AOT check before timing them: aot_specs(candidates=...) builds
    their specialisations (every switch on, packed with a prompt index), one per candidate."""
    sc = kernels.shape_class(128, 16, 64, torch.bfloat16, True, True)
    candidates = {(kernel, sc): kernels.tune_space(kernel, sc)[:3] for kernel in kernels.KERNELS}
    specs = kernels.aot_specs(candidates=candidates)
    assert len(specs) == 9 and len({s.name for s in specs}) == 9
    assert all(s.signature["Q"] == "*bf16" and s.constexprs["VARLEN"] and s.constexprs["HAS_PIDX"] for s in specs)


TOY = textwrap.dedent('''
    import triton
    import triton.language as tl
    from fastprompt.kernels.aot import KernelSpec

    @triton.jit
    def copy(X, Y, N, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(Y + o, tl.load(X + o, mask=o < N), mask=o < N)

    @triton.jit
    def square(X, Y, BLOCK: tl.constexpr):
        # an exact fp32 64x64x64 product in one warp: far more live values than registers
        o = tl.arange(0, BLOCK)
        x = tl.load(X + o[:, None] * BLOCK + o[None, :])
        tl.store(Y + o[:, None] * BLOCK + o[None, :], tl.dot(x, x, input_precision="ieee"))

    @triton.jit
    def half_square(X, Y, BLOCK: tl.constexpr):
        # a half-precision 64x64x64 product in one warpgroup: tensor cores (wgmma on sm_90, mma.sync on sm_80)
        o = tl.arange(0, BLOCK)
        x = tl.load(X + o[:, None] * BLOCK + o[None, :])
        tl.store(Y + o[:, None] * BLOCK + o[None, :], tl.dot(x, x))

    def aot_specs(full=False):
        return [KernelSpec("copy", copy, {"X": "*fp32", "Y": "*fp32", "N": "i32"}, {"BLOCK": 256},
                           divisible_by_16=("X", "Y")),
                KernelSpec("square", square, {"X": "*fp32", "Y": "*fp32"}, {"BLOCK": 64}, num_warps=1),
                KernelSpec("half_square", half_square, {"X": "*fp16", "Y": "*fp32"}, {"BLOCK": 64}, num_warps=4,
                           divisible_by_16=("X", "Y"))]
''')


@pytest.mark.heavy  # AOT compiles
def test_aot_helper_reports_registers_spills_and_tensor_core_instructions(tmp_path, monkeypatch):
    (tmp_path / "toy_aot_kernels.py").write_text(TOY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    rows = {(r.name, r.cc): r for r in aot.check_module("toy_aot_kernels", ccs=(80, 90), jobs=1)}
    copy, square = rows["copy", 90], rows["square", 90]
    assert copy.fits and copy.n_regs > 0 and copy.n_spills == 0 and copy.spill_stores == 0
    assert copy.shared_limit == aot.SHARED_MEM_LIMIT[90] == 232448
    assert not square.fits and square.spill_stores > 0 and square.local_bytes > 0 and square.shared > 0
    # the mma column: none for a copy and an exact fp32 product (FMA units), the tensor-core instruction of
    # each architecture for a half-precision product
    assert copy.mma == square.mma == "none" and not copy.tensor_cores
    assert rows["half_square", 90].mma == "wgmma" and rows["half_square", 80].mma == "mma"
    # the CLI fails (exit 1) when a kernel does not fit
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "fastprompt.kernels.aot", "toy_aot_kernels", "--cc", "90"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "square" in proc.stdout and "NO" in proc.stdout


def test_compile_refuses_interpreted_kernels():
    spec = kernels.aot_specs()[0]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        aot.compile_spec(spec, 90)
    with pytest.raises(ValueError, match="compute capability"):
        aot.compile_spec(spec, 75)


def test_a_block_whose_registers_exceed_the_multiprocessor_does_not_fit():
    """240 registers x 16 warps x 32 threads = 122,880 > 65,536: ptxas compiles it, the launch would fail."""
    base = dict(name="k", cc=90, n_spills=0, local_bytes=0, spill_stores=0, shared=0, shared_limit=232448,
                num_stages=2)
    assert aot.KernelResources(n_regs=240, num_warps=16, **base).fits is False
    assert aot.KernelResources(n_regs=255, num_warps=8, **base).fits is True  # 65,280

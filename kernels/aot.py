"""Ahead-of-time compilation of Triton kernels for real GPUs, without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` runs the whole Triton → PTX →
cubin pipeline on the CPU (ptxas ships inside the triton wheel). From the cubin we read the register
count and the per-thread local memory (register spills) with the wheel's ``cuobjdump``; the shared
memory Triton allocates is ``metadata.shared``; the matrix instructions the SASS holds say whether a
kernel's products run on tensor cores (``HGMMA``: Hopper's warpgroup ``wgmma``; ``HMMA``: ``mma.sync``, the
Ampere-style tensor-core instruction; neither: the FMA units). Tests use this to prove that every specialisation an op
can launch fits the device (no spills, shared memory within the per-block limit) on sm_80 and sm_90.

A kernel module exposes its launchable specialisations as ``aot_specs(full: bool) -> list[KernelSpec]``;
:func:`check_module` compiles them for the requested compute capabilities. Under ``TRITON_INTERPRET=1``
(the tests) ``@triton.jit`` returns interpreter objects that cannot be compiled, so
:func:`check_module` runs the compilation in a fresh subprocess with the interpreter switched off.

CLI: ``python -m fastprompt.kernels.aot fastprompt.kernels.prefix_attention --cc 80 90 [--full]``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)

# Maximum dynamic shared memory per block (opt-in), bytes: H100 (sm_90) and A100 (sm_80).
SHARED_MEM_LIMIT = {90: 232448, 80: 166912}
# 32-bit registers per multiprocessor (and at most per block) on sm_80 and sm_90.
REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class KernelSpec:
    """One specialisation of a ``@triton.jit`` kernel, as the launcher would compile it.

    ``signature`` maps every runtime argument name to its Triton type (``"*fp16"``, ``"i32"``,
    ``"fp32"``); ``constexprs`` maps every ``tl.constexpr`` argument to its value. ``divisible_by_16``
    names the arguments (pointers from the caching allocator, strides of contiguous dims) that Triton
    would specialise as 16-divisible at launch, so the AOT code matches what runs (vectorised loads).
    """

    name: str
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 2
    divisible_by_16: tuple = field(default_factory=tuple)
    # the launcher's ``maxnreg`` (PTX .maxnreg), if it sets one: with it ptxas allocates up to the bound
    # instead of its occupancy heuristic, which can otherwise choose fewer registers and spill
    maxnreg: int | None = None


@dataclass(frozen=True)
class KernelResources:
    """What the compiled cubin needs per thread / per block on one compute capability."""

    name: str
    cc: int
    n_regs: int  # registers per thread
    n_spills: int  # spilled 4-byte words per thread (local memory / 4, as Triton's own ``n_spills``)
    local_bytes: int  # per-thread local memory: stack frame (where ptxas spills) + explicit local arrays
    spill_stores: int  # STL (store-to-local) instructions in the SASS
    shared: int  # bytes of shared memory per block (metadata.shared)
    shared_limit: int
    num_warps: int
    num_stages: int
    # the fastest tensor-core instruction in the SASS: "wgmma" (HGMMA, sm_90), "mma" (HMMA: mma.sync) or "none"
    mma: str = "none"

    @property
    def tensor_cores(self) -> bool:
        return self.mma != "none"

    @property
    def registers_fit(self) -> bool:
        """A block's registers (per thread x its threads) within the multiprocessor's 64K: otherwise it cannot
        launch at all (ptxas does not refuse it; the launch fails)."""
        return self.n_regs * self.num_warps * 32 <= REGISTERS_PER_SM

    @property
    def fits(self) -> bool:
        return (self.n_spills == 0 and self.spill_stores == 0 and self.shared <= self.shared_limit
                and self.registers_fit)


def _jit_function(fn):
    # An Autotuner / Heuristics wrapper keeps the JITFunction in .fn.
    while not hasattr(fn, "cache_key") and hasattr(fn, "fn"):
        if type(fn).__name__ == "InterpretedFunction":
            raise RuntimeError(
                "cannot compile an interpreted kernel: TRITON_INTERPRET=1 was set when the kernel module "
                "was imported; use check_module(), which compiles in a subprocess without the interpreter"
            )
        fn = fn.fn
    return fn


def cuobjdump_path() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"cuobjdump not found at {path} (the triton wheel ships it with the CUDA backend)")
    return path


_RES_RE = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


_SASS_FN_RE = re.compile(r"Function : (\S+)")
_STL_RE = re.compile(r"\bSTL(\.[A-Z0-9]+)*\b")
# tensor-core instructions in SASS, fastest first: Hopper's warpgroup MMA (wgmma in PTX), then mma.sync
_MMA_SASS = (("wgmma", re.compile(r"\bHGMMA\b")), ("mma", re.compile(r"\bHMMA\b")))


def cubin_resources(cubin: bytes) -> dict:
    """``{function: {"regs", "stack", "static_shared", "local", "stl", "mma"}}`` from ``cuobjdump -res-usage``,
    the number of STL (spill store) instructions in ``cuobjdump -sass`` and the fastest tensor-core instruction
    kind there (``"wgmma"``, ``"mma"`` or ``"none"``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump_path(), "-res-usage", f.name], capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump_path(), "-sass", f.name], capture_output=True, text=True, check=True)
    found = {
        m.group(1): {"regs": int(m.group(2)), "stack": int(m.group(3)), "static_shared": int(m.group(4)),
                     "local": int(m.group(5)), "stl": 0, "mma": "none"}
        for m in _RES_RE.finditer(res.stdout)
    }
    if not found:
        raise RuntimeError(f"could not parse cuobjdump -res-usage output:\n{res.stdout}")
    current = None
    for line in sass.stdout.splitlines():
        m = _SASS_FN_RE.search(line)
        if m:
            current = m.group(1)
        elif current in found:
            if _STL_RE.search(line):
                found[current]["stl"] += 1
            for rank, (kind, pattern) in enumerate(_MMA_SASS):
                have = found[current]["mma"]
                if pattern.search(line) and (have == "none" or rank < [k for k, _ in _MMA_SASS].index(have)):
                    found[current]["mma"] = kind
    return found


def compile_spec(spec: KernelSpec, cc: int) -> KernelResources:
    """Compile ``spec`` for ``GPUTarget("cuda", cc, 32)`` and read its resource usage."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if cc not in SHARED_MEM_LIMIT:
        raise ValueError(f"unknown compute capability {cc}; known: {sorted(SHARED_MEM_LIMIT)}")
    fn = _jit_function(spec.fn)
    signature = dict(spec.signature)
    for name in spec.constexprs:
        signature[name] = "constexpr"
    missing = [a for a in fn.arg_names if a not in signature]
    if missing:
        raise ValueError(f"{spec.name}: signature lacks arguments {missing}")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible_by_16}
    src = ASTSource(fn, signature=signature, constexprs=dict(spec.constexprs), attrs=attrs)
    compiled = triton.compile(
        src, target=GPUTarget("cuda", cc, 32),
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                 **({"maxnreg": spec.maxnreg} if spec.maxnreg is not None else {})}
    )
    res = cubin_resources(compiled.asm["cubin"])
    res = res.get(compiled.metadata.name) or next(iter(res.values()))
    local = res["local"] + res["stack"]
    return KernelResources(
        name=spec.name, cc=cc, n_regs=res["regs"], n_spills=local // 4, local_bytes=local, spill_stores=res["stl"],
        shared=int(compiled.metadata.shared) + res["static_shared"], shared_limit=SHARED_MEM_LIMIT[cc],
        num_warps=spec.num_warps, num_stages=spec.num_stages, mma=res["mma"],
    )


def _compile_indexed(args):
    module, full, index, cc = args
    import importlib

    spec = importlib.import_module(module).aot_specs(full=full)[index]
    return asdict(compile_spec(spec, cc))


def compile_module(module: str, ccs=(80, 90), full: bool = False, jobs: int | None = None) -> list[KernelResources]:
    """Compile every ``aot_specs(full)`` entry of ``module`` for each cc, in this process (no interpreter)."""
    import importlib

    n = len(importlib.import_module(module).aot_specs(full=full))
    work = [(module, full, i, cc) for cc in ccs for i in range(n)]
    jobs = jobs or min(len(work), os.cpu_count() or 1)
    if jobs <= 1:
        rows = [_compile_indexed(w) for w in work]
    else:
        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_compile_indexed, work))
    return [KernelResources(**r) for r in rows]


def check_module(module: str, ccs=(80, 90), full: bool = False, jobs: int | None = None,
                 timeout: float = 1800) -> list[KernelResources]:
    """:func:`compile_module` in a fresh Python with ``TRITON_INTERPRET`` unset (safe from the tests)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "fastprompt.kernels.aot", module, "--json", "--cc", *map(str, ccs)]
    if full:
        cmd.append("--full")
    if jobs:
        cmd += ["--jobs", str(jobs)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"AOT compilation of {module} failed:\n{out.stderr[-4000:]}")
    return [KernelResources(**r) for r in json.loads(out.stdout)]


def format_table(rows: list[KernelResources]) -> str:
    lines = [f"{'kernel':44s} {'cc':>3s} {'warps':>5s} {'stages':>6s} {'regs':>5s} {'spills':>6s} {'STL':>4s} "
             f"{'shared':>7s} {'limit':>7s} {'mma':>5s} fits"]
    for r in rows:
        lines.append(f"{r.name:44s} {r.cc:3d} {r.num_warps:5d} {r.num_stages:6d} {r.n_regs:5d} {r.n_spills:6d} "
                     f"{r.spill_stores:4d} {r.shared:7d} {r.shared_limit:7d} {r.mma:>5s} {'yes' if r.fits else 'NO'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("module", help="kernel module exposing aot_specs(full), e.g. fastprompt.kernels.prefix_attention")
    p.add_argument("--cc", type=int, nargs="+", default=[80, 90], help="compute capabilities (80, 90)")
    p.add_argument("--full", action="store_true", help="every specialisation, not only the CI representative set")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled for a GPU")
    rows = compile_module(args.module, tuple(args.cc), full=args.full, jobs=args.jobs)
    print(json.dumps([asdict(r) for r in rows]) if args.json else format_table(rows))
    # --json is for check_module, whose caller asserts on the rows; the table mode fails loudly.
    return 0 if args.json or all(r.fits for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

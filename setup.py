"""Build script: packages `kernels/` as `fastprompt.kernels` and compiles `csrc/` into `fastprompt._C`.

The C++ extension (the CPU kernels) is optional and compiles against the torch it finds when the build runs, so it
must be the torch the package will run with: build it with ``pip install --no-build-isolation .`` (torch installed
first). torch is deliberately not a build requirement in pyproject.toml: in pip's default isolated build environment
it would resolve to the newest PyPI torch (a multi-GB CUDA build), and an extension compiled against it is not
guaranteed to load with the torch actually installed (PyTorch keeps no C++ ABI promise across versions).
Without torch at build time (a plain ``pip install .``), without a compiler, or with FASTPROMPT_NO_EXT=1, the
package installs without the extension and its ops fall back to their PyTorch references with a one-time warning
(GPUs use the Triton kernels either way).
"""
import glob
import os
import sys

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and os.environ.get("FASTPROMPT_NO_EXT", "0") != "1":
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("fastprompt: torch is not importable in the build environment, so the C++ CPU kernels are not built; "
              "install torch first and build with `pip install --no-build-isolation .` to get them", file=sys.stderr)
    else:
        ext_modules = [
            CppExtension(
                "fastprompt._C",
                sources,
                extra_compile_args=["-O3", "-fopenmp"],
                extra_link_args=["-fopenmp"],
            )
        ]
        cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(
    packages=find_packages(include=["fastprompt", "fastprompt.*"]) + ["fastprompt.kernels"],
    package_dir={"fastprompt.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)

"""Build script: packages `kernels/` as `fastprompt.kernels` and compiles `csrc/` into `fastprompt._C`.

The C++ extension is optional: without a compiler (or with FASTPROMPT_NO_EXT=1) the package installs
without it and the ops fall back to their PyTorch references with a one-time warning.
"""
import glob
import os

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}
sources = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
if sources and os.environ.get("FASTPROMPT_NO_EXT", "0") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

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

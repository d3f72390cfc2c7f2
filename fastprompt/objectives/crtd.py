"""Moved to :mod:`fastprompt.methods.crtd.term`: a deprecation shim (:mod:`fastprompt._moved`) that keeps
old imports working, with one FutureWarning."""
from fastprompt._moved import shim_module

__getattr__ = shim_module(__name__)

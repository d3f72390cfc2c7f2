"""Public names that moved, and the deprecation shims that keep them importable from where they were.

Earlier releases documented these names at their old places (``from fastprompt.objectives import SimCSE``, the
README's and docs' imports): user code written against them keeps working, with one ``FutureWarning`` per name
saying where it lives now. The shims resolve the new place only when the old name is used (a run-time import, so
the layering stays as it is: nothing below ``methods`` imports it). The table is the one list of what moved;
``docs/api.md`` lists the public API as it is now, and tests/test_public_api.py checks both.
"""
from __future__ import annotations

import importlib
import warnings

#: old dotted name -> new dotted name (a module or an attribute of one)
MOVED = {
    # issue 26: each method's loss or term moved into its folder under fastprompt/methods/
    "fastprompt.objectives.SimCSE": "fastprompt.methods.simcse.objective.SimCSE",
    "fastprompt.objectives.split_views": "fastprompt.methods.simcse.objective.split_views",
    "fastprompt.objectives.PromCSEEH": "fastprompt.methods.promcse.objective.PromCSEEH",
    "fastprompt.objectives.SKICSE": "fastprompt.methods.skicse.objective.SKICSE",
    "fastprompt.objectives.MLMTerm": "fastprompt.methods.mlm.term.MLMTerm",
    "fastprompt.objectives.MLMConfig": "fastprompt.methods.mlm.config.MLMConfig",
    "fastprompt.objectives.config.MLMConfig": "fastprompt.methods.mlm.config.MLMConfig",
    "fastprompt.objectives.config.CRTDConfig": "fastprompt.methods.crtd.config.CRTDConfig",
    "fastprompt.objectives.simcse": "fastprompt.methods.simcse.objective",
    "fastprompt.objectives.promcse_eh": "fastprompt.methods.promcse.objective",
    "fastprompt.objectives.skicse": "fastprompt.methods.skicse.objective",
    "fastprompt.objectives.mlm": "fastprompt.methods.mlm.term",
    "fastprompt.objectives.crtd": "fastprompt.methods.crtd.term",
    # issue 43: SKICSE's settings moved from the shared objective section to its own
    "fastprompt.objectives.config.check_ski_weights": "fastprompt.methods.skicse.config.check_ski_weights",
    # issue 43: the backend rule is a layer above choices, which re-exported it (an import circle)
    **{f"fastprompt.choices.{name}": f"fastprompt.backends.{name}" for name in (
        "BackendUnavailableError", "UnsupportedInputError", "resolve_backend")},
    # SKI generation moved from the data package to the SKICSE method
    **{f"fastprompt.data.ski.{name}": f"fastprompt.methods.skicse.generation.{name}" for name in (
        "AnswerFilter", "Backend", "DEFAULT_LOCAL_MODEL", "Generation", "GenerationReport", "LLMServerError",
        "LocalBackend", "REJECT_REASONS", "SKI_PROMPT_TEMPLATE", "Sampling", "ServerBackend", "clean_answer",
        "echo_ratio", "generate_ski")},
}

_warned: set[str] = set()


def resolve(old: str):
    """The object (or module) that ``old`` names now, with a FutureWarning the first time ``old`` is used."""
    new = MOVED[old]
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"{old} moved to {new}; import it from there (the old name will be removed in a later "
                      "release)", FutureWarning, stacklevel=3)
    try:
        return importlib.import_module(new)
    except ModuleNotFoundError:
        module, _, attr = new.rpartition(".")
        return getattr(importlib.import_module(module), attr)


def moved_names(module: str) -> list[str]:
    """The old names directly under ``module`` (e.g. ``SimCSE`` for ``fastprompt.objectives``)."""
    prefix = module + "."
    return [old[len(prefix):] for old in MOVED if old.startswith(prefix) and "." not in old[len(prefix):]]


def module_getattr(module: str, fallback=None):
    """A module ``__getattr__`` serving ``module``'s moved names (then ``fallback``, e.g. a lazy face's table)."""
    def __getattr__(name: str):
        if f"{module}.{name}" in MOVED:
            return resolve(f"{module}.{name}")
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def shim_module(module: str):
    """The ``__getattr__`` of an old module that moved as a whole: every attribute comes from the new module."""
    def __getattr__(name: str):
        target = resolve(module)
        return getattr(target, name)

    return __getattr__

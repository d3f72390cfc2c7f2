"""The training methods, one folder each, each registered with one :func:`register_method` call in its
``__init__.py`` (see :mod:`fastprompt.methods.registry` and ``docs/methods.md``).

Importing this package registers the built-in methods (``import fastprompt`` does); the order of
:data:`BUILTIN` is the order of their config sections and of the ``objective`` key's choices. Standard library
only.
"""
from __future__ import annotations

import importlib

from fastprompt.methods.registry import (
    METHODS,
    MethodSpec,
    commands,
    load,
    objective_sections,
    register_method,
    sections,
    unregister_method,
)

#: The built-in methods' folders, imported (so registered) in this order.
BUILTIN = ("simcse", "promcse", "skicse", "mlm", "crtd", "promptbert", "optiprompt")

for _name in BUILTIN:
    importlib.import_module(f"{__name__}.{_name}")

__all__ = ["BUILTIN", "METHODS", "MethodSpec", "commands", "load", "objective_sections", "register_method", "sections",
           "unregister_method"]

"""Lazy exports (PEP 562) for the package ``__init__`` modules: a name is imported from its module on first access,
so importing a package stays light (the config and the CLI's argument checks run before torch is imported)."""
from __future__ import annotations

import importlib


def lazy_getattr(package: str, table: dict[str, str]):
    """The module ``__getattr__`` of ``package`` serving ``table`` (exported name -> module, absolute or relative
    to ``package``), and the names that moved away from ``package`` (:mod:`fastprompt._moved`: with a warning)."""
    from fastprompt._moved import module_getattr

    def lazy(name: str):
        if name in table:
            return getattr(importlib.import_module(table[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return module_getattr(package, lazy)

"""How a value a user gave appears in an error message: bounded, whatever its size or depth.

A config value can be a 10 MB string, a list of a million items or (through YAML aliases) a structure whose
``repr`` would take gigabytes; an error message that quoted it whole would itself exhaust the memory or flood
the terminal. :func:`shown` is ``repr`` cut to a few dozen characters per string, a few items per container and
a few levels deep (:mod:`reprlib`), and at most :data:`MAX_CHARS` in all. Standard library only.
"""
from __future__ import annotations

import math
import reprlib

#: The longest text :func:`shown` returns.
MAX_CHARS = 120


class _Repr(reprlib.Repr):
    def repr_int(self, x, level):
        if x.bit_length() > 128:  # repr() of a 5000-digit integer raises; its size is what matters
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return repr(x)


_repr = _Repr()
_repr.maxlevel = 3
_repr.maxstring = 60
_repr.maxother = 60
_repr.maxlong = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = _repr.maxfrozenset = 6


def shown(value) -> str:
    """``repr(value)`` bounded for an error message: ``'aaaa...aaaa'``, ``[1, 2, 3, 4, 5, 6, ...]``."""
    try:
        text = _repr.repr(value)
    except Exception:  # a broken __repr__ must not hide the error being reported
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."

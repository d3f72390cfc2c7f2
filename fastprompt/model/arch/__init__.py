"""The model families fastprompt adapts: one module per family, each registering a :class:`Family` spec per
``model_type`` with one line (docs/architectures.md, "Adding an architecture"). :func:`family_of` gives a loaded
backbone's spec and :func:`apply` applies it (:class:`fastprompt.model.backbone.Architecture` calls both).
"""
from .family import (
    FAMILIES,
    Adapter,
    Applied,
    Family,
    Upstream,
    apply,
    family_of,
    onnx_model_types,
    packable_model_types,
    register_family,
    unregister_family,
)

# the built-in families, in the order of docs/architectures.md's table (importing a module registers it)
from . import bert, encoders, mpnet, decoders, deberta  # noqa: E402,F401,I001  isort: skip

__all__ = ["FAMILIES", "Adapter", "Applied", "Family", "Upstream", "apply", "family_of", "onnx_model_types",
           "packable_model_types", "register_family", "unregister_family"]

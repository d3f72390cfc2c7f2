"""A model family's spec (:class:`Family`), the registry by ``model_type`` and the one mechanism that applies a
spec to a loaded backbone (:func:`apply`).

A family reaches fastprompt in one of two ways. Its attention goes through transformers' attention functions
(``attention="interface"``): fastprompt's function, registered through transformers' ``AttentionInterface``
(:func:`fastprompt.model.attention.register_attention`), adds each layer's prefix and nothing else is needed. Or its
modules compute attention themselves (``"adapters"``, MPNet): :class:`Adapter` entries replace one method of each
such module instance of the loaded model (never the class: other models in the process are untouched) by a function
that computes it with the prefix. A family whose attention bypasses both (``"bypassed"``, DeBERTa-v2) is refused by
the guard at its first prompted forward (:func:`fastprompt.model.attention.check_prefix_consumed`), with
:attr:`Family.refused` saying why.

Besides, a spec names the output modules that get the fused dropout + add + LayerNorm in training
(:mod:`fastprompt.model.add_norm`), the last-layer class that can compute the pooled rows only
(:mod:`fastprompt.model.pooled_rows`), whether its packed forward is tested equal to the padded one, why PEFT's
prefix tuning does not run it, and its row of docs/architectures.md's table.

Every replaced method is an :class:`Upstream`: a transformers class, named by module and class, and the signature
of the method the replacement was written against (plus a hash of its source, which the tests compare:
tests/model/test_families.py). :func:`apply` refuses a backbone whose upstream method's signature differs (a
transformers release changed the class: the replacement would be called wrongly), instead of falling back silently.
transformers' own ``transformers.monkey_patching`` registry is not used: it swaps classes by name in every
transformers module for every model built in the process (the user's own ``AutoModel`` loads included), where
fastprompt adapts only the instances it loads.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

#: the ways a family's prompt can enter attention (see the module docstring)
ATTENTION_PATHS = ("interface", "adapters", "bypassed")
#: the "packed batches" column of docs/architectures.md's table
PACKED_ROWS, PACKED, NOT_PACKED = "yes, last layer for the pooled rows only", "yes", "no"


@dataclass(frozen=True)
class Upstream:
    """One method of a transformers class that fastprompt replaces on the instances it loads: ``module`` and
    ``name`` locate the class (imported when first needed); ``signature`` is ``str(inspect.signature(method))``
    and ``source_sha`` the first 16 hex digits of the sha256 of ``inspect.getsource(method)``, as the replacement
    was written against them."""

    module: str
    name: str
    signature: str
    source_sha: str
    method: str = "forward"

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}.{self.method}"

    def cls(self) -> type:
        """The class, imported; ImportError naming it when this transformers has no such class."""
        cls = getattr(importlib.import_module(self.module), self.name, None)
        if not isinstance(cls, type):
            raise ImportError(f"{self.module} has no class {self.name}: fastprompt adapts it (transformers renamed "
                              "or removed it; see docs/architectures.md, 'Adding an architecture')")
        return cls

    def current(self) -> tuple[str, str]:
        """(signature, source sha) of the method in the installed transformers."""
        method = getattr(self.cls(), self.method)
        return str(inspect.signature(method)), source_sha(method)

    def check_signature(self) -> None:
        """RuntimeError when the installed transformers' method has another signature than the one pinned."""
        signature = str(inspect.signature(getattr(self.cls(), self.method)))
        if signature != self.signature:
            raise RuntimeError(f"transformers changed {self.qualname}: its signature is now {signature}, fastprompt's "
                               f"replacement was written for {self.signature}; re-check the replacement against "
                               "the new code and update its Upstream pin in fastprompt/model/arch/")


def source_sha(function: Callable) -> str:
    """The first 16 hex digits of the sha256 of ``function``'s source (the pin of :class:`Upstream`)."""
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Adapter:
    """``upstream``'s method, on each instance of its class in a loaded backbone, replaced by
    ``functools.partial(function, module, slot)``: the function takes the module, the
    :class:`~fastprompt.model.attention.OwnAttention` slot holding the forward's prefix state, and the method's own
    arguments. ``reproduces``: other upstream methods whose maths the function computes too (pinned alike)."""

    upstream: Upstream
    function: Callable
    reproduces: tuple[Upstream, ...] = ()


@dataclass(frozen=True)
class Family:
    """Everything fastprompt knows about one ``model_type`` (see the module docstring)."""

    model_type: str
    #: the family's name, for docs and messages ("BERT-like encoders")
    family: str
    #: how the prompt enters attention: one of :data:`ATTENTION_PATHS`
    attention: str = "interface"
    #: methods of attention modules replaced by the prefix's adapters (``attention="adapters"``)
    adapters: tuple[Adapter, ...] = ()
    #: output modules (dense -> dropout -> LayerNorm(h + input)) that get the fused op in training
    add_norm: tuple[Upstream, ...] = ()
    #: the last-layer class whose forward :func:`fastprompt.model.pooled_rows.install` wraps, and the function
    #: computing the pooled rows only (layer, packed hidden states, state) -> (1, R, hidden)
    pooled_rows: Adapter | None = None
    #: its packed forward is tested equal to the padded one (tests/model/test_packed.py)
    packs: bool = False
    #: why prefix prompts cannot work on it (the guard refuses them at the first forward), None when they do
    refused: str | None = None
    #: why PEFT's prefix tuning does not run it (peft 0.21.2, transformers 5.24; each tested), None when it does:
    #: export refuses to write an adapter PEFT cannot apply, and accelerate_peft has no PEFT behaviour to reproduce
    peft: str | None = None
    #: its ONNX export (fastprompt.integrations.onnx) is tested equal to encode (tests/integrations/test_onnx_export.py)
    onnx: bool = False
    #: the module names LoRA adapts by default (PEFT's suffix match): every attention projection and, where one
    #: name covers them, the feed-forward's too; empty: ``lora_target_modules`` must name them
    lora_targets: tuple[str, ...] = ()
    #: weight matrices of its feed-forward (2: up and down; 3: a gated one's gate, up and down, or ModernBERT's
    #: double-width Wi and Wo), for the step's FLOPs (:mod:`fastprompt.train.flops`)
    ffn_matrices: int = 2
    #: docs/architectures.md's table: the "prefix prompts", "pooling" and "compared with" columns
    prefix: str = "supported"
    pooling: str = "cls, mean, mask, ..."
    compared: tuple[str, ...] = ("explicit concatenation", "AutoModel")

    def __post_init__(self):
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"Family.attention must be one of {', '.join(ATTENTION_PATHS)}, got {self.attention!r}")
        if (self.attention == "adapters") != bool(self.adapters):
            raise ValueError("Family.adapters are given exactly when attention='adapters'")
        if (self.attention == "bypassed") != (self.refused is not None):
            raise ValueError("Family.refused (the reason) is given exactly when attention='bypassed'")

    def upstreams(self) -> list[Upstream]:
        """Every transformers method this family replaces (the signatures :func:`apply` checks)."""
        rows = [self.pooled_rows] if self.pooled_rows is not None else []
        return [u for a in (*self.adapters, *rows) for u in (a.upstream, *a.reproduces)] + list(self.add_norm)

    def docs_row(self) -> str:
        """Its row of docs/architectures.md's table."""
        packed = PACKED_ROWS if self.pooled_rows is not None else PACKED if self.packs else NOT_PACKED
        return f"| {self.model_type} | {self.prefix} | {self.pooling} | {packed} | {', '.join(self.compared)} |"


#: model_type -> its family's spec; built-in families register when :mod:`fastprompt.model.arch` is imported
FAMILIES: dict[str, Family] = {}


def register_family(spec: Family) -> Family:
    """Teach fastprompt a model family (docs/architectures.md, "Adding an architecture"); ValueError when its
    ``model_type`` is registered already."""
    if spec.model_type in FAMILIES:
        raise ValueError(f"model_type {spec.model_type!r} is already registered "
                         f"(family {FAMILIES[spec.model_type].family!r})")
    FAMILIES[spec.model_type] = spec
    return spec


def unregister_family(model_type: str) -> Family:
    """Remove a registered family (tests that register their own); returns its spec."""
    return FAMILIES.pop(model_type)


def family_of(model_type: str | None) -> Family:
    """The spec of ``model_type``; for a model type no family registers, a spec that adapts nothing (its attention
    goes through the attention functions, or the guard stops it) and packs nothing."""
    return FAMILIES.get(model_type) or Family(str(model_type), "not covered", prefix="untested", packs=False)


def onnx_model_types() -> list[str]:
    """The model types whose ONNX export is tested equal to encode, in registration order."""
    return [t for t, f in FAMILIES.items() if f.onnx]


def packable_model_types() -> list[str]:
    """The model types whose packed forward is tested equal to the padded one, in registration order."""
    return [t for t, f in FAMILIES.items() if f.packs]


@dataclass
class Applied:
    """What :func:`apply` did to one backbone."""

    #: the slot of the adapters' prefix state (``attention="adapters"``), else None
    own_attention: object | None = None
    #: how many output modules run the fused dropout + add + LayerNorm in training
    fused_add_norm: int = 0
    #: the last layer can compute the pooled rows only, in packed batches
    pooled_rows_only: bool = False


def apply(spec: Family, backbone, layers) -> Applied:
    """Apply ``spec`` to a loaded ``backbone`` (``layers``: its list of layers, or None): the adapters, the fused
    add + LayerNorm and the pooled-rows last layer, each on the instances of its upstream class only, after
    checking that every upstream method has the signature its replacement was written for."""
    from .. import add_norm, pooled_rows
    from ..attention import OwnAttention

    for upstream in spec.upstreams():
        upstream.check_signature()
    applied = Applied()
    modules = list(backbone.modules())
    if spec.adapters:
        slot = OwnAttention()
        for adapter in spec.adapters:
            cls = adapter.upstream.cls()
            for m in modules:
                if type(m) is cls:
                    setattr(m, adapter.upstream.method, functools.partial(adapter.function, m, slot))
                    applied.own_attention = slot
    if spec.add_norm:
        applied.fused_add_norm = add_norm.install(backbone, tuple(u.cls() for u in spec.add_norm))
    if spec.pooled_rows is not None and layers:
        applied.pooled_rows_only = pooled_rows.install(layers, spec.pooled_rows.upstream.cls(),
                                                       spec.pooled_rows.function)
    return applied

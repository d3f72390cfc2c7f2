"""The fused dropout + residual add + LayerNorm (:func:`fastprompt.ops.add_norm.dropout_add_layer_norm`) in the
BERT-style output modules that close each attention and feed-forward block (``BertSelfOutput``, ``BertOutput``
and their copies in RoBERTa, XLM-RoBERTa, ELECTRA, MPNet's feed-forward, ...):

    hidden_states = self.dense(hidden_states)
    hidden_states = self.dropout(hidden_states)
    hidden_states = self.LayerNorm(hidden_states + input_tensor)

Which classes compute exactly that is the family spec's (:attr:`fastprompt.model.arch.Family.add_norm`, each an
``Upstream`` pinning the forward's signature and source, which tests/model/test_families.py compares with the
installed transformers). :func:`install` adapts the instances of those classes whose ``dropout`` and ``LayerNorm``
are a plain ``nn.Dropout`` and an ``nn.LayerNorm`` over the last dimension; any other module runs as it is. It
replaces the ``forward`` of each such module instance (not the class: other models in the process are untouched)
by :func:`_fused_forward`: while its dropout is active (training, 0 < p < 1) on float32 CPU activations with the C++
extension built, the dropout, the add and the LayerNorm run as the one fused op; otherwise (evaluation, another
device or dtype) the module's own three steps run, so evaluation is bit for bit the model's.

The dropout decisions come from the fused op's Philox generator, seeded from torch's default CPU generator: the
same distribution as ``nn.Dropout``, other draws (docs/speed.md). Hooks registered on the ``dropout`` or
``LayerNorm`` submodules do not run in the fused path.
"""
from __future__ import annotations

import functools

import torch

from fastprompt.ops import add_norm


def _fits(module: torch.nn.Module) -> bool:
    ln = getattr(module, "LayerNorm", None)
    return (type(getattr(module, "dropout", None)) is torch.nn.Dropout and type(ln) is torch.nn.LayerNorm
            and len(ln.normalized_shape) == 1 and isinstance(getattr(module, "dense", None), torch.nn.Module))


def install(backbone: torch.nn.Module, classes: tuple[type, ...]) -> int:
    """Give every module of ``backbone`` whose class is one of ``classes`` (exactly: a subclass may compute
    otherwise) the fused op (see the module docstring); returns how many were adapted."""
    modules = [m for m in backbone.modules() if type(m) in classes and _fits(m)
               and not isinstance(m.forward, functools.partial)]
    for m in modules:
        m.forward = functools.partial(_fused_forward, m)
    return len(modules)


def _fused_forward(module, hidden_states, input_tensor):
    hidden_states = module.dense(hidden_states)
    dropout, ln = module.dropout, module.LayerNorm
    p = float(dropout.p)
    if (dropout.training and 0.0 < p < 1.0 and add_norm.applies(hidden_states, p)
            and input_tensor.dtype == hidden_states.dtype and input_tensor.shape == hidden_states.shape
            and ln.normalized_shape[0] == hidden_states.shape[-1]):
        return add_norm.dropout_add_layer_norm(hidden_states, input_tensor, ln.weight, ln.bias, ln.eps, p)
    return ln(dropout(hidden_states) + input_tensor)

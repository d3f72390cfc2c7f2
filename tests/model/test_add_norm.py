"""The fused dropout + residual add + LayerNorm in the backbones' output modules (fastprompt/model/add_norm.py):
which modules get it, that training runs it with the module's maths (checked against the plain-PyTorch reference
with the op's own dropout decisions replayed from torch's RNG state), and that everywhere else the module's own
forward runs, bit for bit.

float32 tolerance (atol = rtol = 1e-5): the adapted module and the reference compute the same dense layer
(the same aten op on the same inputs: equal) and then one LayerNorm of 32 values each, in different summation
orders: a few ulps of O(1) values (tests/ops/test_dropout_add_norm.py's analysis).
"""
import functools

import pytest
import torch

from fastprompt.model import PromptConfig
from fastprompt.model import add_norm as model_add_norm
from fastprompt.ops import _cpp, add_norm
from fastprompt.ops.reference import dropout_add_layer_norm_reference

from .test_architectures import (
    BYPASSING,
    DECODERS,
    ENCODERS,
    SENTENCES,
    _encoder,
)

pytestmark = [pytest.mark.skipif(not _cpp.available(), reason=str(_cpp.missing_reason())),
              pytest.mark.usefixtures("one_thread")]  # tests/conftest.py

#: adapted modules per layer: the attention block's and the feed-forward's output (MPNet: the feed-forward's only;
#: its attention module adds and normalises inside its own forward)
PER_LAYER = {"bert": 2, "roberta": 2, "xlm-roberta": 2, "electra": 2, "mpnet": 1}


def _adapted(enc):
    return [m for m in enc.backbone.modules() if isinstance(m.forward, functools.partial)
            and m.forward.func is model_add_norm._fused_forward]


@pytest.mark.parametrize("model_type", [*ENCODERS, "mpnet", "llama", "gemma"])
def test_the_bert_style_output_modules_are_adapted(model_type):
    extra = {**ENCODERS, **BYPASSING, **DECODERS}[model_type]
    enc = _encoder(model_type, extra, PromptConfig(prompt_length=2))
    layers = enc.backbone.config.num_hidden_layers
    assert len(_adapted(enc)) == enc.architecture.fused_add_norm == PER_LAYER.get(model_type, 0) * layers


def _bert_output(train=True, dtype=torch.float32):
    enc = _encoder("bert", dict(hidden_dropout_prob=0.3), PromptConfig(prompt_length=2), dtype=dtype)
    module = enc.backbone.encoder.layer[0].output  # BertOutput: intermediate (64) -> dense -> hidden (32)
    module.train(train)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 5, 64, generator=g, dtype=dtype, requires_grad=True)
    inp = torch.randn(3, 5, 32, generator=g, dtype=dtype, requires_grad=True)
    return module, h, inp


def test_training_runs_the_fused_op_with_the_module_s_maths():
    module, h, inp = _bert_output()
    state = torch.get_rng_state()
    y = module(h, inp)
    torch.set_rng_state(state)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))  # the op's draw
    keep = add_norm.keep_mask(15, 32, 0.3, seed).view(3, 5, 32)
    hd, inpd = (t.detach().requires_grad_() for t in (h, inp))
    ln = module.LayerNorm
    ref = dropout_add_layer_norm_reference(module.dense(hd), inpd, ln.weight, ln.bias, ln.eps, 0.3, keep)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    for got, want in zip(torch.autograd.grad(y, (h, inp), dy), torch.autograd.grad(ref, (hd, inpd), dy)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the draws are the op's, not nn.Dropout's: the module's own forward with the same RNG state drops others
    torch.set_rng_state(state)
    own = type(module).forward(module, h, inp)
    assert (own - y).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["eval", "float64", "no dropout"])
def test_elsewhere_the_module_s_own_forward_runs_bit_for_bit(case):
    module, h, inp = _bert_output(train=case != "eval", dtype=torch.float64 if case == "float64" else torch.float32)
    if case == "no dropout":
        module.dropout.p = 0.0
    torch.manual_seed(3)
    got = module(h, inp)
    torch.manual_seed(3)
    assert torch.equal(got, type(module).forward(module, h, inp))


def test_a_training_forward_reaches_the_fused_op_in_every_adapted_module(monkeypatch):
    enc = _encoder("bert", dict(hidden_dropout_prob=0.1), PromptConfig(prompt_length=2), dtype=torch.float32)
    calls = []
    real = add_norm.dropout_add_layer_norm
    monkeypatch.setattr(add_norm, "dropout_add_layer_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    enc.train()
    enc(**enc.tokenize(SENTENCES)).sum().backward()
    assert len(calls) == len(_adapted(enc)) == 4
    calls.clear()
    with torch.no_grad():
        enc.eval()(**enc.tokenize(SENTENCES))
    assert not calls


def test_a_module_with_another_forward_or_dropout_is_left_alone():
    from transformers.models.bert.modeling_bert import BertConfig, BertOutput

    class Scaled(BertOutput):  # another forward: the residual scaled
        def forward(self, hidden_states, input_tensor):
            return self.LayerNorm(self.dropout(self.dense(hidden_states)) + 0.5 * input_tensor)

    config = BertConfig(hidden_size=32, intermediate_size=64, hidden_dropout_prob=0.1)
    plain, scaled, swapped = BertOutput(config), Scaled(config), BertOutput(config)
    swapped.dropout = torch.nn.Identity()
    root = torch.nn.ModuleList([plain, scaled, swapped])
    assert model_add_norm.install(root, (BertOutput,)) == 1  # a subclass is not the class the spec names
    assert isinstance(plain.forward, functools.partial)
    assert not isinstance(scaled.forward, functools.partial)
    assert not isinstance(swapped.forward, functools.partial)
    assert model_add_norm.install(root, (BertOutput,)) == 0  # installing twice adapts nothing more

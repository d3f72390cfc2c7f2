"""LoRA's default targets (each family's ``lora_targets``, fastprompt.model.arch) on a tiny model of every family that
has them:
each target adapts a linear layer in every layer of the backbone and nothing outside them, every adapter gets a
gradient through fastprompt's forward, and the packed forward still equals the padded one with adapters in.

Tolerance of the packed/padded comparison as in tests/model/test_packed.py: float64 models, the two forwards differ
in summation order only (~1e-16 relative per product), so 1e-10 is far above rounding and far below any real
difference (a lost or misplaced adapter, lora_B ~ N(0, 0.2), moves the output by ~1e-1).
"""
import pytest
import torch

from fastprompt.model.arch import FAMILIES as ARCH_FAMILIES
from tests.model.test_architectures import BYPASSING, DECODERS, ENCODERS, SENTENCES, _encoder

ARCHS = {**ENCODERS, **DECODERS, **BYPASSING}
DEFAULT_TARGETS = {t: f.lora_targets for t, f in ARCH_FAMILIES.items() if f.lora_targets}
FAMILIES = [t for t in DEFAULT_TARGETS if t in ARCHS]


def _lora_encoder(model_type, **lora):
    enc = _encoder(model_type, ARCHS[model_type])
    enc.add_lora(rank=2, alpha=4.0, **lora)
    with torch.no_grad():
        for name, p in enc.backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(len(name)))
    return enc


def test_every_family_with_defaults_is_tested():
    assert set(DEFAULT_TARGETS) <= set(ARCHS), sorted(set(DEFAULT_TARGETS) - set(ARCHS))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_default_targets_adapt_every_layer_and_train(model_type):
    from peft.tuners.lora import LoraLayer

    enc = _lora_encoder(model_type)
    adapted = [n for n, m in enc.backbone.named_modules() if isinstance(m, LoraLayer)]
    targets = DEFAULT_TARGETS[model_type]
    for t in targets:
        for layer in range(enc.num_layers):  # each target in every layer of the layer list
            assert any(n.endswith("." + t) and f".{layer}." in n for n in adapted), (t, layer, adapted)
    assert all(any(n.endswith("." + t) for t in targets) for n in adapted)
    assert not any(n.startswith("pooler") for n in adapted)
    trainable = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)

    enc.train()
    for m in enc.modules():  # dropout off: the gradient check below is deterministic
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    inputs = enc.tokenize(SENTENCES)
    enc(**inputs).square().sum().backward()
    missing = [n for n, p in enc.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.any())]
    assert not missing, missing


@pytest.mark.parametrize("model_type", FAMILIES)
def test_packed_forward_equals_padded_with_adapters(model_type):
    enc = _lora_encoder(model_type)
    if enc.packing_refusal() is not None:
        pytest.skip(enc.packing_refusal())
    inputs = enc.tokenize(SENTENCES)
    with torch.no_grad():
        padded = enc(**inputs)
        packed = enc.pack_sequences()(**inputs)
    torch.testing.assert_close(packed, padded, atol=1e-10, rtol=0)


def test_a_family_without_defaults_needs_targets():
    enc = _encoder("deberta-v2", ARCHS["deberta-v2"])
    with pytest.raises(ValueError, match=r"LoRA has no default target modules for model_type 'deberta-v2'"):
        enc.add_lora(rank=2, alpha=4.0)
    enc.add_lora(rank=2, alpha=4.0, targets=["query_proj", "value_proj"])
    assert enc.lora is not None


def test_lora_and_a_trained_backbone_exclude_each_other():
    enc = _encoder("bert", ARCHS["bert"])
    enc.add_lora(rank=2, alpha=4.0)
    with pytest.raises(ValueError, match="holds LoRA adapters: training its weights too"):
        enc.train_backbone()
    with pytest.raises(ValueError, match="already holds LoRA adapters"):
        enc.add_lora(rank=2, alpha=4.0)
    full = _encoder("bert", ARCHS["bert"]).train_backbone()
    with pytest.raises(ValueError, match="fully fine-tuned"):
        full.add_lora(rank=2, alpha=4.0)

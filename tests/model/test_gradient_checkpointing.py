"""Gradient checkpointing of the backbone layers with prompts attached: same outputs, same prompt gradients."""
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["a man plays the guitar .", "the dog runs", "two people sit at a big table .", "it"]


def _grads(enc, batch, seed):
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = enc(batch["input_ids"], batch["attention_mask"])
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in enc.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("options", [dict(), dict(prefix_projection=True, projection_hidden_size=16,
                                                  prompt_dropout=0.2, cls_prompt=True)],
                         ids=["plain", "projection-dropout-cls"])
def test_checkpointing_gives_identical_gradients_with_dropout_on(tiny_model_dir, options, monkeypatch):
    import fastprompt.ops

    calls = []
    real_op = fastprompt.ops.prefix_attention
    monkeypatch.setattr(fastprompt.ops, "prefix_attention", lambda *a, **k: calls.append(1) or real_op(*a, **k))
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(4, **options), mlp="train")
    enc.train()  # backbone dropout and prompt dropout active
    batch = enc.tokenize(SENTENCES)
    out_a, g_a = _grads(enc, batch, seed=123)
    assert len(calls) == enc.num_layers
    enc.gradient_checkpointing_enable()
    assert enc.is_gradient_checkpointing
    assert enc.backbone.config.use_cache is False  # else transformers warns about caching every run
    out_b, g_b = _grads(enc, batch, seed=123)
    assert len(calls) == 3 * enc.num_layers, "each layer must be recomputed in backward"
    torch.testing.assert_close(out_a, out_b, atol=1e-6, rtol=1e-6)
    assert g_a.keys() == g_b.keys() and len(g_a) >= 2
    for name in g_a:
        assert g_a[name].abs().sum() > 0, name
        torch.testing.assert_close(g_a[name], g_b[name], atol=1e-6, rtol=1e-6, msg=name)
    # a different seed gives different dropout, so the equality above is not vacuous
    out_c, _ = _grads(enc, batch, seed=7)
    assert not torch.allclose(out_a, out_c)
    enc.gradient_checkpointing_enable(False)
    assert not enc.is_gradient_checkpointing

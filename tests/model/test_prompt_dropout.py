"""Prompt dropout draws an independent mask per example, as P-tuning v2 / DCPCSE's ``get_prompt`` does (it expands
the prefix over the batch, then applies dropout), on the fused attention path and the DynamicCache path alike.

Tolerance of the path comparison: the same masks (same seed, drawn once in PrefixPrompt before either path) and
the same fp32 weights; the paths differ only in the attention kernel's summation order (~1e-7 relative per
layer over 2 layers and hidden 32), so 1e-5 leaves two orders of margin.
"""
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.prefix import PrefixPrompt

SAME = ["a man plays the guitar ."] * 4


def test_each_example_draws_its_own_prefix_mask():
    prompt = PrefixPrompt(PromptConfig(4, prompt_dropout=0.5), 2, 4, 8).train()
    torch.manual_seed(0)
    per_example = prompt(batch_size=3)
    assert per_example.shape == (3, *prompt.prefix.shape)
    assert not torch.equal(per_example[0], per_example[1])
    kept = per_example != 0
    torch.testing.assert_close(per_example[kept], (prompt.prefix.expand_as(per_example) * 2)[kept])
    layers = prompt.layer_prefixes(per_example)
    assert layers[1][0].shape == (3, 4, 4, 8) and torch.equal(layers[1][1], per_example[:, 1, 1])
    prompt.eval()  # no dropout: the stored prefix, never expanded
    assert torch.equal(prompt(batch_size=3), prompt.prefix)
    assert PrefixPrompt(PromptConfig(4), 2, 4, 8).train()(batch_size=3).dim() == 5  # p = 0: not expanded


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_identical_rows_differ_under_prompt_dropout_on_both_paths(tiny_bert_dir, backend):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3, prompt_dropout=0.5, init_std=1.0),
                                        attn_backend=backend)
    enc.backbone.eval()  # only the prompt's dropout is on: any difference between rows comes from it
    enc.prompt.train()
    batch = enc.tokenize(SAME)
    torch.manual_seed(7)
    fused = enc.hidden_states(batch["input_ids"], batch["attention_mask"])
    assert not torch.allclose(fused[0], fused[1], atol=1e-4)  # one shared mask would give equal rows
    enc.prefix_mode = "cache"
    torch.manual_seed(7)
    cached = enc.hidden_states(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(fused, cached, atol=1e-5, rtol=1e-5)
    enc.prompt.eval()
    enc.prefix_mode = "attention"
    out = enc.hidden_states(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(out[0], out[1], atol=1e-6, rtol=1e-6)


def test_per_example_prefix_gradients_reach_the_stored_prefix(tiny_bert_dir):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3, prompt_dropout=0.3)).train()
    batch = enc.tokenize(SAME[:2] + ["the dog runs"])
    enc(batch["input_ids"], batch["attention_mask"]).pow(2).sum().backward()
    assert enc.prompt.prefix.grad is not None and enc.prompt.prefix.grad.abs().sum() > 0

"""The DynamicCache reference path hands the cache to the backbone under the name its forward declares: ``cache``
(transformers >= 5.24, which deprecates ``past_key_values`` with a FutureWarning and removes it in 5.40), else
``past_key_values``.

Tolerance: the parity test compares the cache path with the fused attention path, both fp32 over the same keys; the
reduction order may differ (~1e-7 relative per layer), and hidden states are O(1) LayerNorm outputs, so 1e-5
absolute, as in tests/model/test_encoder.py, is a wide margin that a missing or misplaced prefix exceeds by orders.
"""
import warnings

import pytest
import torch
from transformers import AutoModel

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.attention import cache_keyword

SENTENCES = ["a man plays the guitar .", "the dog runs", "it"]


class _NewForward(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, **kwargs):
        return cache


class _OldForward(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        return past_key_values


def test_keyword_follows_the_forward_signature():
    assert cache_keyword(_NewForward()) == "cache"
    assert cache_keyword(_OldForward()) == "past_key_values"


def test_the_installed_transformers_gets_what_its_bert_declares(tiny_model_dir):
    import inspect

    backbone = AutoModel.from_pretrained(tiny_model_dir)
    declared = inspect.signature(type(backbone).forward).parameters
    assert cache_keyword(backbone) == ("cache" if "cache" in declared else "past_key_values")


@pytest.mark.parametrize("position_mode", ["standard", "shifted"])
def test_cache_path_warns_nothing_and_matches_the_attention_path(tiny_model_dir, position_mode):
    torch.manual_seed(0)
    config = PromptConfig(prompt_length=3, init_std=0.5, position_mode=position_mode)
    fast = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=config).eval()
    ref = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=config, prefix_mode="cache").eval()
    ref.load_state_dict(fast.state_dict())
    batch = fast.tokenize(SENTENCES)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' past_key_values deprecation among them
        with torch.no_grad():
            ours = ref.hidden_states(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        expected = fast.hidden_states(batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    # the prefix really arrived: without it the outputs differ
    plain = PromptEncoder.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        bare = plain.hidden_states(batch["input_ids"], batch["attention_mask"])
    assert (bare - ours).abs().max() > 1e-2

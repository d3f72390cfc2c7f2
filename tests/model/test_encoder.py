"""PromptEncoder: prefix attention path vs the DynamicCache reference, freezing, determinism, encode API."""
import numpy as np
import pytest
import torch

from fastprompt.model import PrefixPrompt, PromptConfig, PromptEncoder

SENTENCES = ["a man plays the guitar .", "the dog runs", "two people sit at a big table with water and food .",
             "it"]


def _pair(model_dir, config: PromptConfig, **kwargs):
    """The same prompt on the fast attention path and on the DynamicCache reference path."""
    torch.manual_seed(1)
    fast = PromptEncoder.from_pretrained(model_dir, prompt_config=config, **kwargs)
    ref = PromptEncoder.from_pretrained(model_dir, prompt_config=config, prefix_mode="cache", **kwargs)
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def _grads(encoder, batch, weights):
    encoder.zero_grad(set_to_none=True)
    hidden = encoder.hidden_states(batch["input_ids"], batch["attention_mask"])
    (hidden * weights).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in encoder.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("options", [
    dict(),
    dict(prefix_projection=True, projection_hidden_size=24),
    dict(shared_across_layers=True, prompt_length=1),
    dict(position_mode="shifted", prompt_length=5),
    dict(cls_prompt=True, prompt_length=3),
], ids=["plain", "projection", "shared-P1", "shifted", "cls-prompt"])
def test_prefix_path_matches_dynamic_cache_reference(tiny_model_dir, options):
    config = PromptConfig(**{"prompt_length": 4, "init_std": 0.5, **options})
    fast, ref = _pair(tiny_model_dir, config)
    fast.eval(), ref.eval()
    batch = fast.tokenize(SENTENCES)
    assert (batch["attention_mask"] == 0).any(), "the batch must contain padding"
    weights = torch.randn(*batch["input_ids"].shape, fast.hidden_size)
    out_fast, g_fast = _grads(fast, batch, weights)
    out_ref, g_ref = _grads(ref, batch, weights)
    torch.testing.assert_close(out_fast, out_ref, atol=1e-5, rtol=1e-5)
    assert g_fast.keys() == g_ref.keys() and len(g_fast) > 0
    for name in g_fast:
        torch.testing.assert_close(g_fast[name], g_ref[name], atol=1e-5, rtol=1e-5, msg=name)


def test_prompt_changes_the_output_and_positions_mode_matters(tiny_bert_dir):
    plain = PromptEncoder.from_pretrained(tiny_bert_dir).eval()
    prompted = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4, init_std=0.5)).eval()
    shifted = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4, position_mode="shifted"))
    shifted.load_state_dict(prompted.state_dict())
    shifted.eval()
    a, b, c = (e.encode(SENTENCES) for e in (plain, prompted, shifted))
    assert not np.allclose(a, b, atol=1e-4)
    assert not np.allclose(b, c, atol=1e-4)


def test_backbone_frozen_only_prompt_gets_gradients(tiny_model_dir):
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(3, cls_prompt=True), mlp="train")
    enc.train()
    batch = enc.tokenize(SENTENCES)
    enc(batch["input_ids"], batch["attention_mask"]).pow(2).sum().backward()
    assert all(p.grad is None for p in enc.backbone.parameters())
    assert not any(p.requires_grad for p in enc.backbone.parameters())
    names = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert names == {"prompt.prefix", "cls_prompt", "pooler.head.0.weight", "pooler.head.0.bias"}
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in enc.trainable_parameters())


def test_training_mode_applies_backbone_dropout_eval_is_deterministic(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    batch = enc.tokenize(SENTENCES)
    enc.train()
    a, b = (enc(batch["input_ids"], batch["attention_mask"]) for _ in range(2))
    assert not torch.allclose(a, b), "dropout (SimCSE's augmentation) must act in training mode"
    enc.eval()
    with torch.no_grad():
        c, d = (enc(batch["input_ids"], batch["attention_mask"]) for _ in range(2))
    assert torch.equal(c, d)


def test_prefix_shape_is_stored_once_per_layer(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(7))
    assert enc.prompt.prefix.shape == (2, 2, 4, 7, 8)  # (layers, 2, heads, P, head_dim)
    projected = PrefixPrompt(PromptConfig(5, prefix_projection=True, projection_hidden_size=16), 3, 4, 8)
    assert projected().shape == (3, 2, 4, 5, 8)
    only_input = PrefixPrompt(PromptConfig(5, input_layer_only=True), 3, 4, 8)
    layers = only_input.layer_prefixes()
    assert layers[0][0].shape == (4, 5, 8) and layers[1] is None and layers[2] is None


def test_input_layer_only_prompt_changes_the_output(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4, input_layer_only=True,
                                                                                   init_std=0.5)).eval()
    plain = PromptEncoder.from_pretrained(tiny_bert_dir).eval()
    assert enc.prompt.prefix.shape[0] == 1
    assert not np.allclose(enc.encode(SENTENCES), plain.encode(SENTENCES), atol=1e-4)


def test_prompt_dropout_acts_in_training_only(tiny_bert_dir):
    prompt = PrefixPrompt(PromptConfig(4, prompt_dropout=0.5), 2, 4, 8)
    prompt.train()
    assert not torch.equal(prompt(), prompt.prefix)
    prompt.eval()
    assert torch.equal(prompt(), prompt.prefix)


def test_vocab_init_uses_backbone_keys_values(tiny_bert_dir):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3, init="vocab"))
    prefix = enc.prompt.prefix
    assert prefix.abs().mean() > 0.05  # real key/value magnitudes, not the 0.02-std random init
    assert torch.isfinite(prefix).all()


def test_encode_order_normalisation_and_similarity(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2), pooler="mean")
    together = enc.encode(SENTENCES, batch_size=2)
    one_by_one = np.concatenate([enc.encode([s]) for s in SENTENCES])
    np.testing.assert_allclose(together, one_by_one, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    raw = enc.encode(SENTENCES, normalize=False)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)
    sim = enc.similarity(SENTENCES[:2], SENTENCES)
    assert sim.shape == (2, 4)
    np.testing.assert_allclose(np.diag(sim[:, :2]), 1.0, atol=1e-5)


def test_encode_batches_by_token_count(tiny_bert_dir):
    """Ordered by characters, the line of digits (one token each) would be batched with the short lines and pad
    them to its 11 tokens; by token count each batch pads only to its own longest row."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean")
    sentences = ["the man plays the guitar", "1 2 3 4 5 6 7 8 9", "a dog", "the woman"]
    assert enc.tokenize(sentences)["attention_mask"].sum(1).tolist() == [7, 11, 4, 4]
    assert enc.encoding_order(sentences).tolist() == [1, 0, 2, 3]  # ties keep the input order
    shapes, tokenize = [], enc.tokenize
    enc.tokenize = lambda batch, *a, **k: shapes.append(tokenize(batch, *a, **k)["input_ids"].shape) or \
        tokenize(batch, *a, **k)
    got = enc.encode(sentences, batch_size=2)
    assert shapes[-2:] == [(2, 11), (2, 4)]  # the batches encode formed, after the counting pass
    # in input order; against each sentence alone: the same sums in other batch shapes, float32 rounding (~1e-7)
    np.testing.assert_allclose(got, np.concatenate([PromptEncoder.encode(enc, [s]) for s in sentences]), atol=1e-5)


def test_mask_pooler_uses_template(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask")
    batch = enc.tokenize(SENTENCES)
    assert ((batch["input_ids"] == enc.tokenizer.mask_token_id).sum(1) == 1).all()
    assert enc.encode(SENTENCES).shape == (4, 32)
    # with a template, max_length counts the sentence's tokens; the template comes on top
    truncated = enc.tokenize(["the dog " * 50], max_length=20)["input_ids"]
    assert truncated.shape[1] == 20 + enc._template.overhead
    assert (truncated == enc.tokenizer.mask_token_id).sum() == 1


@pytest.mark.parametrize("bad,err", [([], ValueError), ("a sentence", TypeError), (["ok", 3], TypeError),
                                     (["ok", None], TypeError)])
def test_encode_rejects_bad_input(tiny_bert_dir, bad, err):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    with pytest.raises(err):
        enc.encode(bad)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        PromptEncoder.from_pretrained(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError):
        PromptEncoder.from_pretrained("./relative/missing")


@pytest.mark.parametrize("option,value,allowed", [
    ("attn_backend", "bogus", "auto, triton, cpu, reference"),
    ("pooler", "max", "cls, cls_before_pooler, mean, mask, topk, bn_mlp, last"),
    ("mlp", "sometimes", "none, train, always"),
    ("prefix_mode", "kv", "attention, cache"),
])
def test_a_typo_in_a_choice_fails_before_any_weights_load(tmp_path, option, value, allowed):
    """The model path does not exist: the choice is checked first, and the error lists every valid value."""
    with pytest.raises(ValueError, match=f"{option} must be one of {allowed}; got '{value}'"):
        PromptEncoder.from_pretrained(tmp_path / "not-loaded", **{option: value})


def test_construction_checks_attn_backend(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    with pytest.raises(ValueError, match="attn_backend must be one of"):
        PromptEncoder(enc.backbone, enc.tokenizer, attn_backend="bogus")


def test_mismatched_input_shapes(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2))
    ids = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="batch, seq_len"):
        enc(ids, torch.ones(2, 6, dtype=torch.long))


def test_real_minilm_frozen_encoder_matches_sentence_transformers_pooling(minilm_dir):
    """Frozen all-MiniLM-L6-v2 through our attention function == plain transformers + mean pooling."""
    from transformers import AutoModel, AutoTokenizer

    enc = PromptEncoder.from_pretrained(minilm_dir, pooler="mean")
    ours = enc.encode(SENTENCES)
    tok, model = AutoTokenizer.from_pretrained(minilm_dir), AutoModel.from_pretrained(minilm_dir).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_triton_prefix_path_matches_dynamic_cache_reference(tiny_bert_dir):
    """The whole model on the Triton kernels (CPU interpreter) vs the DynamicCache reference."""
    config = PromptConfig(4, init_std=0.5)
    fast, ref = _pair(tiny_bert_dir, config, attn_backend="triton")
    fast.eval(), ref.eval()
    batch = fast.tokenize(SENTENCES)
    weights = torch.randn(*batch["input_ids"].shape, fast.hidden_size)
    out_fast, g_fast = _grads(fast, batch, weights)
    out_ref, g_ref = _grads(ref, batch, weights)
    torch.testing.assert_close(out_fast, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g_fast["prompt.prefix"], g_ref["prompt.prefix"], atol=1e-5, rtol=1e-5)

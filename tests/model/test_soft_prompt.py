"""Input-level soft prompts (prompt_type input/both) and OptiPrompt (trainable template words)."""
import numpy as np
import pytest
import torch
from transformers import AutoModel

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["a man plays a guitar .", "the dog runs", "two people sit at a table in the park .", "it"]
TEMPLATE = 'This sentence : "[X]" means [MASK] .'


def _input_cfg(n, **kw):
    return PromptConfig(prompt_type="input", input_prompt_length=n, init_std=0.5, **kw)


@pytest.mark.parametrize("pooler", ["cls", "mean", "mask"])
def test_zero_length_input_prompt_is_the_plain_model(tiny_model_dir, pooler):
    plain = PromptEncoder.from_pretrained(tiny_model_dir, pooler=pooler).eval()
    soft = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=_input_cfg(0), pooler=pooler).eval()
    assert soft.input_prompt is not None and soft.input_prompt_length == 0 and soft.prompt is None
    batch = plain.tokenize(SENTENCES)
    assert (batch["attention_mask"] == 0).any()
    with torch.no_grad():
        a = plain.hidden_states(batch["input_ids"], batch["attention_mask"])
        b = soft.hidden_states(batch["input_ids"], batch["attention_mask"])
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.as_tensor(plain.encode(SENTENCES)), torch.as_tensor(soft.encode(SENTENCES)),
                               atol=1e-6, rtol=1e-6)


def test_input_prompt_equals_hand_built_reference(tiny_model_dir):
    """Soft tokens right after [CLS], at positions 1..n, text after them at n+1..; padding masked."""
    n = 3
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=_input_cfg(n), pooler="mean").eval()
    model = AutoModel.from_pretrained(tiny_model_dir).eval()
    offset = model.config.pad_token_id + 1 if model.config.model_type == "roberta" else 0
    batch = enc.tokenize(SENTENCES)
    with torch.no_grad():
        ours = enc.hidden_states(batch["input_ids"], batch["attention_mask"])
        for i, s in enumerate(SENTENCES):  # one sentence at a time, no padding anywhere
            ids = torch.tensor([enc.tokenizer(s)["input_ids"]])
            emb = model.get_input_embeddings()(ids)
            emb = torch.cat([emb[:, :1], enc.input_prompt.embedding.unsqueeze(0), emb[:, 1:]], dim=1)
            pos = torch.arange(emb.shape[1]).unsqueeze(0) + offset
            h = model(inputs_embeds=emb, position_ids=pos).last_hidden_state[0]
            ref = torch.cat([h[:1], h[1 + n:]])
            L = ids.shape[1]
            torch.testing.assert_close(ours[i, :L], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooler", ["cls", "mask"])
def test_padding_does_not_change_soft_prompted_outputs(tiny_model_dir, pooler):
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=_input_cfg(4, optiprompt=pooler == "mask"),
                                        pooler=pooler).eval()
    together = enc.encode(SENTENCES, batch_size=4, normalize=False)
    alone = [enc.encode([s], normalize=False)[0] for s in SENTENCES]
    torch.testing.assert_close(torch.as_tensor(together), torch.as_tensor(np.stack(alone)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt_type", ["input", "both"])
def test_gradients_reach_the_vectors(tiny_bert_dir, prompt_type):
    cfg = PromptConfig(2, prompt_type=prompt_type, input_prompt_length=3, optiprompt=True)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=cfg, pooler="mask", denoise=True)
    batch = enc.tokenize(SENTENCES)
    enc(batch["input_ids"], batch["attention_mask"]).pow(2).sum().backward()
    grads = {"input": enc.input_prompt.embedding.grad, "optiprompt": enc.template_words.embedding.grad}
    if prompt_type == "both":
        grads["prefix"] = enc.prompt.prefix.grad
    for name, g in grads.items():
        assert g is not None and g.abs().sum() > 0, name
    assert all(p.grad is None for p in enc.backbone.parameters())


def test_both_attention_path_matches_cache_path(tiny_model_dir):
    cfg = PromptConfig(3, prompt_type="both", input_prompt_length=2, init_std=0.5)
    torch.manual_seed(0)
    a = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=cfg, pooler="mask", denoise=True).eval()
    b = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=cfg, pooler="mask", denoise=True,
                                      prefix_mode="cache").eval()
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(torch.as_tensor(a.encode(SENTENCES, normalize=False)),
                               torch.as_tensor(b.encode(SENTENCES, normalize=False)), atol=1e-5, rtol=1e-5)


def test_optiprompt_initialisation_is_the_template_token_embeddings(tiny_model_dir):
    cfg = PromptConfig(prompt_type="input", input_prompt_length=0, optiprompt=True)
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=cfg, pooler="mask", template=TEMPLATE).eval()
    tok, W = enc.tokenizer, enc.backbone.get_input_embeddings().weight
    words = ["this", "sentence", ":", '"', '"', "means", "."]
    assert tok.convert_ids_to_tokens(enc.template_words.token_ids.tolist()) == words
    torch.testing.assert_close(enc.template_words.embedding.detach(), W[tok.convert_tokens_to_ids(words)].detach(),
                               rtol=0, atol=0)
    # at initialisation the encoder is the plain template model; a sentence repeating template words is untouched
    plain = PromptEncoder.from_pretrained(tiny_model_dir, pooler="mask", template=TEMPLATE).eval()
    sents = SENTENCES + ['this sentence : " means .']
    torch.testing.assert_close(torch.as_tensor(enc.encode(sents)), torch.as_tensor(plain.encode(sents)),
                               atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        enc.template_words.embedding.add_(0.5 * torch.randn_like(enc.template_words.embedding))  # (a constant shift
        # would vanish in the embedding LayerNorm)
    assert not torch.allclose(torch.as_tensor(enc.encode(sents)), torch.as_tensor(plain.encode(sents)), atol=1e-3)


def test_optiprompt_refuses_rows_of_another_template(tiny_bert_dir):
    cfg = PromptConfig(prompt_type="input", input_prompt_length=0, optiprompt=True)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=cfg, pooler="mask")
    plain = enc.tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with pytest.raises(ValueError, match="not sequences of the template"):
        enc(plain["input_ids"], plain["attention_mask"])
    with pytest.raises(ValueError, match="give a template"):
        PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=cfg, pooler="cls")


def test_vocab_init_of_input_prompt_uses_static_embeddings(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=_input_cfg(5, init="vocab"))
    W = enc.backbone.get_input_embeddings().weight
    special = set(enc.tokenizer.all_special_ids)
    for row in enc.input_prompt.embedding:
        match = (W == row).all(1).nonzero().flatten().tolist()
        assert match and not special.intersection(match)


def test_soft_prompts_round_trip_through_checkpoints(tiny_model_dir, tmp_path):
    cfg = PromptConfig(2, prompt_type="both", input_prompt_length=3, optiprompt=True, init_std=0.3)
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=cfg, pooler="mask", denoise=True)
    with torch.no_grad():
        enc.template_words.embedding.add_(0.1)
    enc.save(tmp_path / "ckpt")
    loaded = PromptEncoder.load(tmp_path / "ckpt")
    assert loaded.prompt_config == cfg
    torch.testing.assert_close(loaded.template_words.embedding, enc.template_words.embedding)
    torch.testing.assert_close(torch.as_tensor(loaded.encode(SENTENCES)), torch.as_tensor(enc.encode(SENTENCES)))
    with pytest.raises(ValueError, match="OptiPrompt vectors for the template"):
        PromptEncoder.load(tmp_path / "ckpt", template="[X] means [MASK]")


def test_bad_prompt_type_is_a_clear_error():
    with pytest.raises(ValueError, match="prompt_type must be one of"):
        PromptConfig(prompt_type="deep")
    with pytest.raises(ValueError, match="input_prompt_length"):
        PromptConfig(prompt_type="input", input_prompt_length=-1)

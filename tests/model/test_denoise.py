"""PromptBERT template denoising: the subtracted bias is the [MASK] state of the template fed alone with the
positions it has around the sentence; checked against a hand-built reference on the plain Hugging Face model."""
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["a man plays a guitar .", "the dog runs", "two people sit at a table in the park .", "it",
             "the cat eats"]
TEMPLATE = 'This sentence : "[X]" means [MASK] .'


def _reference(model_dir, template, sentences):
    """Denoised [MASK] states computed by hand with transformers only (eval mode, no prompt)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    offset = model.config.pad_token_id + 1 if model.config.model_type == "roberta" else 0
    before, after = template.replace("[MASK]", tok.mask_token).split("[X]")
    b = tok(before.strip(), add_special_tokens=False)["input_ids"]
    a = tok(after.rstrip(), add_special_tokens=False)["input_ids"]
    cls, sep = tok("")["input_ids"][:1], tok("")["input_ids"][1:]
    out = []
    for s in sentences:
        x = tok(" " + s if before.endswith(" ") else s, add_special_tokens=False)["input_ids"]
        ids = cls + b + x + a + sep
        m = ids.index(tok.mask_token_id, len(cls + b + x))
        with torch.no_grad():
            h = model(input_ids=torch.tensor([ids]),
                      position_ids=torch.arange(len(ids)).unsqueeze(0) + offset).last_hidden_state[0, m]
            alone = cls + b + a + sep
            pos = [i if i < len(cls + b) else i + len(x) for i in range(len(alone))]  # after [X]: shifted by L
            bias = model(input_ids=torch.tensor([alone]),
                         position_ids=torch.tensor([pos]) + offset).last_hidden_state[0, alone.index(tok.mask_token_id)]
        out.append(h - bias)
    return torch.stack(out)


@pytest.mark.parametrize("which", ["bert", "roberta", "roberta_bpe"])
def test_denoised_equals_hand_built_reference(which, tiny_bert_dir, tiny_roberta_dir, tiny_roberta_bpe_dir):
    model_dir = {"bert": tiny_bert_dir, "roberta": tiny_roberta_dir, "roberta_bpe": tiny_roberta_bpe_dir}[which]
    template = "This sentence : ' [X] ' means [MASK]." if which == "roberta_bpe" else TEMPLATE
    enc = PromptEncoder.from_pretrained(model_dir, pooler="mask", template=template, denoise=True)
    ours = enc.encode(SENTENCES, normalize=False, batch_size=3, convert_to_numpy=False)
    ref = _reference(model_dir, template, SENTENCES)
    # fp32, a 2-layer model, hidden 32: the same ops in another batch layout (padding, SDPA masks) differ by
    # rounding only (~1e-6 relative); 1e-5 leaves margin on any CPU kernel path
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    plain = PromptEncoder.from_pretrained(model_dir, pooler="mask", template=template)
    assert not torch.allclose(plain.encode(SENTENCES, normalize=False, convert_to_numpy=False), ref, atol=1e-2)


@pytest.mark.parametrize("position_mode", ["standard", "shifted"])
def test_bias_with_prompt_agrees_between_attention_and_cache_paths(tiny_model_dir, position_mode):
    """With a prefix (and its position shift), the fused attention path and the DynamicCache reference path
    give the same template bias: the explicit positions reach the backbone in both."""
    cfg = PromptConfig(3, init_std=0.5, position_mode=position_mode)
    torch.manual_seed(0)
    a = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=cfg, pooler="mask", denoise=True).eval()
    b = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=cfg, pooler="mask", denoise=True,
                                      prefix_mode="cache").eval()
    b.load_state_dict(a.state_dict())
    lengths = torch.tensor([0, 1, 5, 5, 9])
    with torch.no_grad():
        torch.testing.assert_close(a.template_bias(None, lengths), b.template_bias(None, lengths),
                                   atol=1e-5, rtol=1e-5)
        assert not torch.allclose(a.template_bias(None, lengths)[1], a.template_bias(None, lengths)[2])


def test_eval_cache_hits_and_invalidation(tiny_bert_dir, monkeypatch):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2), pooler="mask",
                                        denoise=True).eval()
    calls = []
    real = enc._bias_for
    monkeypatch.setattr(enc, "_bias_for", lambda tpl, L: calls.append(L.tolist()) or real(tpl, L))
    first = enc.encode(SENTENCES, normalize=False)
    assert calls and sorted(sum(calls, [])) == sorted(set(sum(calls, [])))  # each length computed once
    calls.clear()
    again = enc.encode(SENTENCES, normalize=False)
    assert calls == [] and (first == again).all()  # every (template, length) came from the cache
    with torch.no_grad():
        enc.prompt.prefix.add_(0.1)  # a parameter changed in place (an optimizer step, a checkpoint load)
    changed = enc.encode(SENTENCES, normalize=False)
    assert calls and not (changed == first).all()


def test_training_bias_carries_gradient_and_matches_eval_without_dropout(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2), pooler="mask", denoise=True)
    batch = enc.tokenize(SENTENCES)
    enc.train()
    assert enc.template_bias(None, torch.tensor([3])).requires_grad  # gradients also flow through the bias
    enc(batch["input_ids"], batch["attention_mask"]).pow(2).sum().backward()  # (LayerNorm rows sum to 0)
    assert enc.prompt.prefix.grad is not None and enc.prompt.prefix.grad.abs().sum() > 0
    for m in enc.modules():  # train mode without dropout: the uncached path must equal the cached one
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    train_out = enc(batch["input_ids"], batch["attention_mask"]).detach()
    enc.eval()
    with torch.no_grad():
        torch.testing.assert_close(enc(batch["input_ids"], batch["attention_mask"]), train_out)


def test_sentence_lengths_and_template_inputs(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template=TEMPLATE)
    tpl = enc._template
    batch = enc.tokenize(SENTENCES)
    lengths = enc.sentence_lengths(tpl, batch["attention_mask"])
    assert lengths.tolist() == [len(enc.tokenizer(s, add_special_tokens=False)["input_ids"]) for s in SENTENCES]
    ids, pos = enc.template_inputs(tpl, torch.tensor([0, 4]))
    assert ids[0].tolist() == tpl.alone()
    T, start = len(tpl.alone()), tpl.sentence_start
    assert pos[0].tolist() == list(range(T))
    assert pos[1].tolist() == list(range(start)) + [i + 4 for i in range(start, T)]


def test_denoise_needs_the_mask_pooler(tiny_bert_dir):
    with pytest.raises(ValueError, match="needs pooler 'mask'"):
        PromptEncoder.from_pretrained(tiny_bert_dir, pooler="cls", denoise=True)


def test_eval_cache_keeps_autocast_and_float32_biases_apart(tiny_bert_dir):
    """A bias cached under bf16 autocast (bf16 rounding, ~3e-3 relative) is not served to a float32 call, and
    the other way round; each equals a fresh computation in its own numerics."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2), pooler="mask",
                                        denoise=True).eval()
    lengths = torch.tensor([3, 5, 3])

    def fresh():
        enc.clear_template_cache()
        return enc.template_bias(None, lengths)

    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = enc.template_bias(None, lengths)
            assert torch.equal(low, fresh())
        assert not torch.equal(low.float(), enc.template_bias(None, lengths).float())  # not the bf16 entry
        full = enc.template_bias(None, lengths)
        assert full.dtype == torch.float32 and torch.equal(full, fresh())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(enc.template_bias(None, lengths), low)  # its own entry, not the float32 one
        assert len(enc._bias_cache) == 2

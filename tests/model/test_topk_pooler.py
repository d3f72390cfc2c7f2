"""The ``topk`` pooler (PromptBERT Eq. 3) against a hand-built reference on the Hugging Face masked-LM model."""
import pytest
import torch
from transformers import AutoModelForMaskedLM

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["a man plays a guitar .", "the dog runs", "two people sit at a table in the park .", "it"]


@pytest.mark.parametrize("which", ["bert", "roberta"])
@pytest.mark.parametrize("k", [1, 7])
def test_topk_equals_reference(which, k, tiny_bert_mlm_dir, tiny_roberta_bpe_dir):
    model_dir = tiny_bert_mlm_dir if which == "bert" else tiny_roberta_bpe_dir
    enc = PromptEncoder.from_pretrained(model_dir, pooler="topk", topk=k)
    ours = enc.encode(SENTENCES, normalize=False, convert_to_numpy=False)
    mlm = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
    batch = enc.tokenize(SENTENCES)
    with torch.no_grad():
        logits = mlm(**batch).logits  # the whole masked-LM model: backbone + its own head
    rows = torch.arange(len(SENTENCES))
    at_mask = logits[rows, (batch["input_ids"] == enc.tokenizer.mask_token_id).int().argmax(1)]
    p = at_mask.softmax(-1)
    top = p.topk(k, -1)
    W = mlm.get_input_embeddings().weight.detach()
    ref = ((top.values / top.values.sum(-1, keepdim=True)).unsqueeze(-1) * W[top.indices]).sum(1)
    # fp32 softmax over a 400-token vocabulary and a k-term weighted sum: rounding ~1e-7 relative
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_topk_without_mlm_head_is_a_clear_error(tiny_bert_dir):
    with pytest.raises(ValueError, match=r"no MLM head weights \(cls\.\*\).*ForMaskedLM"):
        PromptEncoder.from_pretrained(tiny_bert_dir, pooler="topk")


def test_topk_round_trips_and_trains_the_prompt(tiny_bert_mlm_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_mlm_dir, prompt_config=PromptConfig(2), pooler="topk", topk=5)
    batch = enc.tokenize(SENTENCES)
    enc.train()
    enc(batch["input_ids"], batch["attention_mask"]).pow(2).sum().backward()
    assert enc.prompt.prefix.grad.abs().sum() > 0
    assert not any(k.startswith("mlm_head") for k in enc.prompt_state_dict())  # the frozen head is not saved
    assert all(not p.requires_grad for p in enc.mlm_head.parameters())
    enc.save(tmp_path / "ckpt")
    loaded = PromptEncoder.load(tmp_path / "ckpt")
    assert loaded.pooler.pooler == "topk" and loaded.topk == 5
    torch.testing.assert_close(torch.as_tensor(loaded.encode(SENTENCES)), torch.as_tensor(enc.encode(SENTENCES)))


@pytest.mark.parametrize("which", ["bert", "roberta"])
def test_topk_of_the_denoised_mask_state(which, tiny_bert_mlm_dir, tiny_roberta_bpe_dir):
    """PromptBERT's Table 9 (60.39): top-k over the [MASK] state minus its template bias. Reference: the MLM head
    of the Hugging Face model applied to (h_mask - bias), with h_mask and bias from the denoise-free encoder."""
    model_dir = tiny_bert_mlm_dir if which == "bert" else tiny_roberta_bpe_dir
    k = 7
    enc = PromptEncoder.from_pretrained(model_dir, pooler="topk", topk=k, denoise=True).eval()
    assert enc.denoise
    ours = enc.encode(SENTENCES, normalize=False, convert_to_numpy=False)
    plain = PromptEncoder.from_pretrained(model_dir, pooler="mask").eval()
    batch = plain.tokenize(SENTENCES)
    tpl = plain._resolve_template(None)
    with torch.no_grad():
        h = plain(batch["input_ids"], batch["attention_mask"])
        bias = plain.template_bias(tpl, plain.sentence_lengths(tpl, batch["attention_mask"]))
        mlm = AutoModelForMaskedLM.from_pretrained(model_dir).eval()
        head = mlm.cls if which == "bert" else mlm.lm_head
        p = head(h - bias).softmax(-1)
    top = p.topk(k, -1)
    W = mlm.get_input_embeddings().weight.detach()
    ref = ((top.values / top.values.sum(-1, keepdim=True)).unsqueeze(-1) * W[top.indices]).sum(1)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    undenoised = PromptEncoder.from_pretrained(model_dir, pooler="topk", topk=k).eval()
    assert not torch.allclose(ours, undenoised.encode(SENTENCES, normalize=False, convert_to_numpy=False), atol=1e-4)


def test_topk_defaults_to_the_papers_200():
    import inspect

    from fastprompt.train import TrainConfig

    assert TrainConfig().topk == 200
    assert inspect.signature(PromptEncoder.__init__).parameters["topk"].default == 200

"""``pooler_head: mlm_transform``: PromptBERT's supervised BERT head (its code's ``--mask_embedding_sentence_org_mlp``,
kongds/Prompt-BERT ``train.py`` / ``prompt_bert/models.py`` / ``evaluation.py``): BERT's pretrained MLM transform
(``cls.predictions.transform``: dense + GELU + LayerNorm), trained, applied to the [MASK] state and to the template
bias before one is subtracted from the other, ``T(h) - T(bias)``.

Reference: the transform of Hugging Face's own ``BertForMaskedLM`` on the [MASK] state and the template bias of a
plain (head-free, denoise-free) encoder. fp32 throughout; a dense layer, GELU and LayerNorm over 32 features round
at ~1e-7 relative, so 1e-5 is two orders of margin.
"""
import pytest
import torch
from transformers import BertForMaskedLM

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.train import TrainConfig

SENTENCES = ["a man plays a guitar .", "the dog runs", "two people sit at a table in the park .", "it"]
TEMPLATE = 'This sentence of "[X]" means [MASK] .'


def _encoder(model_dir, mlp="always", **kw):
    return PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(2), pooler="mask", mlp=mlp,
                                         template=TEMPLATE, pooler_head="mlm_transform", **kw)


def _reference(model_dir, enc, transform):
    plain = PromptEncoder.from_pretrained(model_dir, prompt_config=PromptConfig(2), pooler="mask", template=TEMPLATE)
    plain.load_state_dict({k: v for k, v in enc.state_dict().items() if k.startswith("prompt.")}, strict=False)
    plain.eval()
    batch = plain.tokenize(SENTENCES)
    tpl = plain._resolve_template(None)
    with torch.no_grad():
        h = plain(batch["input_ids"], batch["attention_mask"])
        bias = plain.template_bias(tpl, plain.sentence_lengths(tpl, batch["attention_mask"]))
        return h, bias, transform(h) - transform(bias)


def test_transform_applies_to_the_mask_state_and_the_bias_before_subtracting(tiny_bert_mlm_dir):
    enc = _encoder(tiny_bert_mlm_dir, denoise=True).eval()
    hf = BertForMaskedLM.from_pretrained(tiny_bert_mlm_dir).eval()
    assert enc.pooler.head_kind == "mlm_transform"
    for name, p in hf.cls.predictions.transform.state_dict().items():  # the pretrained transform, not a new one
        torch.testing.assert_close(enc.pooler.head.state_dict()[name], p, atol=0, rtol=0)
    ours = enc.encode(SENTENCES, normalize=False, convert_to_numpy=False)
    h, bias, ref = _reference(tiny_bert_mlm_dir, enc, hf.cls.predictions.transform)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the order matters: the transform is not linear
        assert not torch.allclose(ours, hf.cls.predictions.transform(h - bias), atol=1e-3)
        assert not torch.allclose(ours, h - bias, atol=1e-3)


def test_the_transform_trains_and_round_trips(tiny_bert_mlm_dir, tmp_path):
    enc = _encoder(tiny_bert_mlm_dir, denoise=True).train()
    names = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert {"pooler.head.dense.weight", "pooler.head.LayerNorm.weight"} <= names
    batch = enc.tokenize(SENTENCES)
    out = enc(batch["input_ids"], batch["attention_mask"], head=False)  # training: applied in pool(), head or not
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
    assert enc.pooler.head.dense.weight.grad.abs().sum() > 0 and enc.prompt.prefix.grad.abs().sum() > 0
    with torch.no_grad():
        enc.pooler.head.dense.weight.mul_(1.5)
    enc.eval()
    want = enc.encode(SENTENCES)
    enc.save(tmp_path / "ckpt")
    loaded = PromptEncoder.load(tmp_path / "ckpt")
    assert loaded.pooler.head_kind == "mlm_transform" and loaded.denoise
    torch.testing.assert_close(loaded.pooler.head.dense.weight, enc.pooler.head.dense.weight, atol=0, rtol=0)
    torch.testing.assert_close(torch.as_tensor(loaded.encode(SENTENCES)), torch.as_tensor(want), atol=1e-6, rtol=0)


def test_in_training_only_it_is_the_optiprompt_head(tiny_bert_mlm_dir):
    """mlp: train (PromptBERT's OptiPrompt run: --mlp_only_train --mask_embedding_sentence_org_mlp): T(h) in
    training, the raw [MASK] state at test."""
    enc = _encoder(tiny_bert_mlm_dir, mlp="train")
    hf = BertForMaskedLM.from_pretrained(tiny_bert_mlm_dir).eval()
    h, _, _ = _reference(tiny_bert_mlm_dir, enc, hf.cls.predictions.transform)
    torch.testing.assert_close(enc.eval().encode(SENTENCES, normalize=False, convert_to_numpy=False), h,
                               atol=1e-5, rtol=1e-5)
    enc.train()
    for m in enc.modules():  # no dropout, to compare the training forward with the reference
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    batch = enc.tokenize(SENTENCES)
    with torch.no_grad():
        got = enc(batch["input_ids"], batch["attention_mask"])
        torch.testing.assert_close(got, hf.cls.predictions.transform(h), atol=1e-5, rtol=1e-5)


def test_misuse_is_refused(tiny_bert_mlm_dir, tiny_roberta_bpe_dir, tiny_bert_dir):
    with pytest.raises(ValueError, match="needs pooler 'mask' and mlp 'train' or 'always'"):
        PromptEncoder.from_pretrained(tiny_bert_mlm_dir, pooler="cls", mlp="always", pooler_head="mlm_transform")
    with pytest.raises(ValueError, match="needs pooler 'mask' and mlp 'train' or 'always'"):
        PromptEncoder.from_pretrained(tiny_bert_mlm_dir, pooler="mask", pooler_head="mlm_transform")
    with pytest.raises(ValueError, match="no separate transform"):  # RoBERTa's lm_head has none
        _encoder(tiny_roberta_bpe_dir)
    with pytest.raises(ValueError, match="no MLM head weights"):  # a backbone saved without a head
        _encoder(tiny_bert_dir)
    with pytest.raises(ValueError, match="pooler_head must be one of new, mlm_transform"):
        PromptEncoder.from_pretrained(tiny_bert_mlm_dir, pooler="mask", mlp="always", pooler_head="tanh")
    with pytest.raises(ValueError, match="needs pooler mask and mlp train or always"):
        TrainConfig(pooler="cls", mlp="always", pooler_head="mlm_transform")

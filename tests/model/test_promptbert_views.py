"""PromptBERT's two template views, each denoised, built and embedded model-side."""
import pytest
import torch

from fastprompt.model import (
    PROMPTBERT_TEMPLATES,
    PromptBERTConfig,
    PromptConfig,
    PromptEncoder,
    embed_views,
    tokenize_views,
)
from fastprompt.model.promptbert import default_templates

SENTENCES = ["a man plays a guitar .", "the dog runs", "two people sit at a table in the park .", "it"]


@pytest.mark.parametrize("denoise", [True, False])
def test_views_equal_each_template_encoded_on_its_own(tiny_model_dir, denoise):
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(2, init_std=0.3),
                                        pooler="mask").eval()
    t1, t2 = PROMPTBERT_TEMPLATES["bert"]
    views = tokenize_views(enc, [SENTENCES, SENTENCES], [t1, t2], max_length=32)
    assert views.input_ids.shape[0] == 2 * len(SENTENCES) and views.n_views == 2
    with torch.no_grad():
        out = embed_views(enc, views, denoise=denoise)
    assert out.shape == (2, len(SENTENCES), 32)
    for v, t in enumerate((t1, t2)):
        single = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(2), pooler="mask",
                                               template=t, denoise=denoise).eval()
        single.load_state_dict(enc.state_dict())
        ref = single.encode(SENTENCES, normalize=False, convert_to_numpy=False)
        torch.testing.assert_close(out[v], ref, atol=1e-5, rtol=1e-5)


def test_views_in_training_carry_gradients_to_the_prompt(tiny_bert_dir):
    cfg = PromptConfig(2, prompt_type="both", input_prompt_length=2)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=cfg, pooler="mask").train()
    views = tokenize_views(enc, [SENTENCES, SENTENCES], default_templates(enc))
    z = embed_views(enc, views, denoise=True)
    z1, z2 = torch.nn.functional.normalize(z, dim=-1)
    loss = torch.nn.functional.cross_entropy(z1 @ z2.T / 0.05, torch.arange(len(SENTENCES)))
    loss.backward()
    assert enc.prompt.prefix.grad.abs().sum() > 0 and enc.input_prompt.embedding.grad.abs().sum() > 0


def test_default_templates_follow_the_backbone_family(tiny_bert_dir, tiny_roberta_bpe_dir):
    bert = PromptEncoder.from_pretrained(tiny_bert_dir)
    roberta = PromptEncoder.from_pretrained(tiny_roberta_bpe_dir)
    assert default_templates(bert) == PROMPTBERT_TEMPLATES["bert"]
    assert default_templates(roberta) == PROMPTBERT_TEMPLATES["roberta"]
    views = tokenize_views(roberta, [SENTENCES] * 2, default_templates(roberta))
    assert ((views.input_ids == roberta.tokenizer.mask_token_id).sum(1) == 1).all()


def test_views_bad_input(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask")
    with pytest.raises(ValueError, match="one per view"):
        tokenize_views(enc, [SENTENCES], PROMPTBERT_TEMPLATES["bert"])
    with pytest.raises(ValueError, match="same, non-zero number"):
        tokenize_views(enc, [SENTENCES, SENTENCES[:2]], PROMPTBERT_TEMPLATES["bert"])
    with pytest.raises(ValueError, match="one template per view"):
        PromptBERTConfig(templates=("only one [X] [MASK]",))
    cls = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="cls")
    with pytest.raises(ValueError, match="needs pooler 'mask'"):
        embed_views(cls, tokenize_views(cls, [SENTENCES] * 2, PROMPTBERT_TEMPLATES["bert"]))

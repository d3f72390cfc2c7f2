"""PromptBERT's template views through the one views API, training's (fastprompt.methods.promptbert.training):
:class:`TemplateCollator` wraps each view in its template, :class:`TemplateViewEmbedder` runs one backbone pass
and pools each row at its own template's [MASK], denoised or not."""
import pytest
import torch

from fastprompt.methods.promptbert.training import TemplateCollator, TemplateViewEmbedder
from fastprompt.model import PROMPTBERT_TEMPLATES, PromptConfig, PromptEncoder

SENTENCES = ["a man plays a guitar .", "the dog runs", "two people sit at a table in the park .", "it"]


def _views(enc, templates, max_length=32):
    """The rows of two views (view-major: the first template's, then the second's) and their model inputs."""
    collate = TemplateCollator(enc, templates, (0, 1), max_length, columns=("sent0",), views=("sent0", "sent0"),
                               pad_token_id=enc.tokenizer.pad_token_id)
    return collate([(s,) for s in SENTENCES])


@pytest.mark.parametrize("denoise", [True, False])
def test_views_equal_each_template_encoded_on_its_own(tiny_model_dir, denoise):
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(2, init_std=0.3),
                                        pooler="mask").eval()
    t1, t2 = PROMPTBERT_TEMPLATES["bert"]
    batch = _views(enc, (t1, t2))
    assert batch.input_ids.shape[0] == 2 * len(SENTENCES)
    with torch.no_grad():
        out = TemplateViewEmbedder(enc, (t1, t2), denoise)(**batch.model_inputs()).reshape(2, len(SENTENCES), -1)
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
    templates = PROMPTBERT_TEMPLATES["bert"]
    z = TemplateViewEmbedder(enc, templates, True)(**_views(enc, templates).model_inputs())
    z1, z2 = torch.nn.functional.normalize(z.reshape(2, len(SENTENCES), -1), dim=-1)
    loss = torch.nn.functional.cross_entropy(z1 @ z2.T / 0.05, torch.arange(len(SENTENCES)))
    loss.backward()
    assert enc.prompt.prefix.grad.abs().sum() > 0 and enc.input_prompt.embedding.grad.abs().sum() > 0


def test_the_roberta_templates_hold_one_mask_each(tiny_roberta_bpe_dir):
    roberta = PromptEncoder.from_pretrained(tiny_roberta_bpe_dir, pooler="mask")
    batch = _views(roberta, PROMPTBERT_TEMPLATES["roberta"])
    assert ((batch.input_ids == roberta.tokenizer.mask_token_id).sum(1) == 1).all()


def test_views_bad_input(tiny_bert_dir):
    cls = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="cls")
    templates = PROMPTBERT_TEMPLATES["bert"]
    with pytest.raises(ValueError, match="needs pooler 'mask'"):
        TemplateViewEmbedder(cls, templates, True)(**_views(cls, templates).model_inputs())

"""PromptBERT templates: tokenisation per tokenizer family, the max_length rule, CLI and checkpoint round trip."""
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.template import parse_template

SENTENCES = ["a man plays a guitar .", "the dog runs in the park", "two people sit at a table .", "it is red"]
BERT_TEMPLATE = 'This sentence : "[X]" means [MASK] .'
ROBERTA_TEMPLATE = "This sentence : ' [X] ' means [MASK]."


@pytest.mark.parametrize("template", [ROBERTA_TEMPLATE, "This sentence : '[X]' means [MASK] .",
                                      "[X] means [MASK]", "[MASK] : [X]"])
def test_roberta_bpe_template_tokens_equal_the_filled_in_text(tiny_roberta_bpe_dir, template):
    """Byte-level BPE: the template's pieces tokenise as the whole filled-in text does (leading spaces, <mask>)."""
    enc = PromptEncoder.from_pretrained(tiny_roberta_bpe_dir, pooler="mask", template=template)
    tok = enc.tokenizer
    batch = enc.tokenize(SENTENCES)
    for i, s in enumerate(SENTENCES):
        text = template.replace("[X]", s).replace("[MASK]", tok.mask_token)
        expected = tok(text)["input_ids"]
        row = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert row == expected, (tok.convert_ids_to_tokens(row), tok.convert_ids_to_tokens(expected))
        assert row.count(tok.mask_token_id) == 1


def test_roberta_sentence_after_a_space_starts_with_a_word_initial_token(tiny_roberta_bpe_dir):
    enc = PromptEncoder.from_pretrained(tiny_roberta_bpe_dir, pooler="mask", template=ROBERTA_TEMPLATE)
    tpl = enc._template
    assert tpl.space_before_sentence
    ids = enc.tokenize(["dog"])["input_ids"][0].tolist()
    assert enc.tokenizer.convert_ids_to_tokens(ids[tpl.sentence_start]) == "Ġdog"
    glued = PromptEncoder.from_pretrained(tiny_roberta_bpe_dir, pooler="mask", template="[X] means [MASK]")
    ids = glued.tokenize(["dog"])["input_ids"][0].tolist()
    assert glued.tokenizer.convert_ids_to_tokens(ids[1]) == "dog"


def test_bert_template_uses_bert_mask(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template=BERT_TEMPLATE)
    tok = enc.tokenizer
    batch = enc.tokenize(SENTENCES)
    for i, s in enumerate(SENTENCES):
        row = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert row == tok(BERT_TEMPLATE.replace("[X]", s))["input_ids"]
    assert ((batch["input_ids"] == tok.mask_token_id).sum(1) == 1).all()


def test_max_length_counts_the_sentence_and_never_cuts_the_template(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template=BERT_TEMPLATE)
    tpl = enc._template
    long = "the dog " * 50
    sentence_ids = enc.tokenizer(long, add_special_tokens=False)["input_ids"]
    ids = enc.tokenize([long], max_length=7)["input_ids"][0].tolist()
    assert ids == tpl.wrap(sentence_ids[:7]) and len(ids) == 7 + tpl.overhead
    # without max_length only the model's positions bind: the sentence gives way, the template stays whole
    full = enc.tokenize([long * 3])["input_ids"][0].tolist()
    assert len(full) == enc.model_max_tokens() == 64
    assert full[:tpl.sentence_start] == list(tpl.lead + tpl.before)
    assert full[-len(tpl.after) - 1:] == list(tpl.after + tpl.trail)


def test_mask_found_structurally_even_if_the_sentence_contains_one(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template=BERT_TEMPLATE).eval()
    batch = enc.tokenize(["the [MASK] runs", "a dog"])
    assert (batch["input_ids"][0] == enc.tokenizer.mask_token_id).sum() == 2
    hidden = enc.hidden_states(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        vec = enc(batch["input_ids"], batch["attention_mask"])
    last_mask = (batch["input_ids"][0] == enc.tokenizer.mask_token_id).nonzero()[-1, 0]
    torch.testing.assert_close(vec[0], hidden[0, last_mask])


@pytest.mark.parametrize("bad", ["no placeholder [MASK]", "[X] and [X] [MASK]"])
def test_bad_templates_are_clear_errors(tiny_bert_dir, bad):
    with pytest.raises(ValueError, match=r"\[X\] exactly once"):
        PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template=bad)


def test_template_leaving_no_room_is_a_clear_error(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template="the dog " * 40 + "[X] [MASK]")
    with pytest.raises(ValueError, match="no room for a sentence"):
        enc.tokenize(["a"])


def test_template_round_trips_through_the_checkpoint(tiny_model_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_model_dir, prompt_config=PromptConfig(2), pooler="mask",
                                        template="[X] means [MASK] .", denoise=True)
    enc.save(tmp_path / "ckpt")
    loaded = PromptEncoder.load(tmp_path / "ckpt")
    assert loaded.template == "[X] means [MASK] ." and loaded.denoise
    torch.testing.assert_close(torch.as_tensor(loaded.encode(SENTENCES)), torch.as_tensor(enc.encode(SENTENCES)))
    other = PromptEncoder.load(tmp_path / "ckpt", template=BERT_TEMPLATE, denoise=False)
    assert other.template == BERT_TEMPLATE and not other.denoise


def test_parse_template_keeps_template_words(tiny_bert_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    tpl = parse_template(tok, BERT_TEMPLATE)
    assert tok.convert_ids_to_tokens(list(tpl.before)) == ["this", "sentence", ":", '"']
    assert tok.convert_ids_to_tokens(list(tpl.after)) == ['"', "means", "[MASK]", "."]
    assert tok.convert_ids_to_tokens(tpl.word_ids()) == ["this", "sentence", ":", '"', '"', "means", "."]


def test_cli_encode_takes_template_and_denoise(tiny_bert_dir, tmp_path, capsys):
    import numpy as np

    from fastprompt import cli

    src = tmp_path / "in.txt"
    src.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    out = tmp_path / "emb.npy"
    rc = cli.main(["encode", "--no-progress", "--model", str(tiny_bert_dir), "--pooler", "mask", "--template",
                   "[X] means [MASK] .", "--denoise", "--input", str(src), "--output", str(out)])
    assert rc == 0, capsys.readouterr().err
    ref = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template="[X] means [MASK] .", denoise=True)
    np.testing.assert_allclose(np.load(out), ref.encode(SENTENCES), atol=1e-5)
    plain = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", template="[X] means [MASK] .")
    assert not np.allclose(np.load(out), plain.encode(SENTENCES), atol=1e-3)
    rc = cli.main(["encode", "--no-progress", "--model", str(tiny_bert_dir), "--pooler", "mean", "--denoise",
                   "--input", str(src), "--output", str(out)])
    assert rc == 2 and "needs pooler 'mask'" in capsys.readouterr().err

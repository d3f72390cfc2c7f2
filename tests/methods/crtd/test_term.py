"""D2CSE's conditional replaced-token detection: the generators, the term against a plain-PyTorch reference,
and the designs (a), (c), (d)."""
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from fastprompt.data import Collator
from fastprompt.data.replacements import (
    MaskedLMGenerator,
    RandomGenerator,
    ReplacementTable,
    rtd_labels,
    write_replacement_file,
)
from fastprompt.methods.crtd.term import CRTDTerm
from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.attention import build_prefix_cache, cache_keyword
from fastprompt.objectives import WeightSchedule

ROWS = [("a man plays the guitar .",), ("the dog runs",), ("two people sit at a big table with water .",),
        ("it",), ("a woman is eating food in the park",)]


def _batch(enc):
    return Collator(enc.tokenize, 32)(ROWS)


def _tiny_mlm(tok):
    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=128)
    return BertForMaskedLM(cfg)


def test_random_generator_replaces_only_real_non_special_tokens(tiny_bert_dir):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    b = _batch(enc)
    gen = RandomGenerator(tok, 0.3)
    ids, labels = gen.corrupt(b.input_ids, b.attention_mask, torch.Generator().manual_seed(0))
    special = torch.isin(b.input_ids, torch.tensor(tok.all_special_ids))
    changed = ids != b.input_ids
    assert changed.any()
    assert not (changed & (special | ~b.attention_mask.bool())).any()
    assert not torch.isin(ids[changed], torch.tensor(tok.all_special_ids)).any()
    assert torch.equal(labels, rtd_labels(b.input_ids, ids, b.attention_mask))
    assert (labels[:, 0] == -100).all() and (labels[~b.attention_mask.bool()] == -100).all()
    again, _ = gen.corrupt(b.input_ids, b.attention_mask, torch.Generator().manual_seed(0))
    assert torch.equal(again, ids)  # seeded


def test_masked_lm_generator_argmax_is_the_models_prediction_at_the_masked_positions(tiny_bert_dir):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    model = _tiny_mlm(tok)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    b = _batch(enc)
    gen = MaskedLMGenerator(model, tok, 0.5, sampling="argmax")
    ids, labels = gen.corrupt(b.input_ids, b.attention_mask, torch.Generator().manual_seed(3))
    chosen = torch.rand(b.input_ids.shape, generator=torch.Generator().manual_seed(3)) < 0.5
    chosen &= b.attention_mask.bool() & ~torch.isin(b.input_ids, torch.tensor(tok.all_special_ids))
    masked = torch.where(chosen, tok.mask_token_id, b.input_ids)
    with torch.no_grad():
        logits = model(input_ids=masked, attention_mask=b.attention_mask).logits  # HF's own full-vocab path
    logits[..., tok.all_special_ids] = float("-inf")
    expect = torch.where(chosen, logits.argmax(-1), b.input_ids)
    assert torch.equal(ids, expect)
    sampled, _ = MaskedLMGenerator(model, tok, 0.5).corrupt(b.input_ids, b.attention_mask,
                                                             torch.Generator().manual_seed(3))
    assert torch.equal(sampled == b.input_ids, sampled == b.input_ids)  # runs; positions outside chosen kept
    assert torch.equal(sampled[~chosen], b.input_ids[~chosen])


def test_masked_lm_generator_refuses_another_vocabulary(tiny_bert_dir):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    small = BertForMaskedLM(BertConfig(vocab_size=10, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32))
    with pytest.raises(ValueError, match="vocabulary"):
        MaskedLMGenerator(small, tok, 0.3)


def _reference(enc, term, ids, mask, labels, h, prompted):
    """Plain PyTorch: the embedding layer's output with row i's position 0 set to h[i], then the encoder layers
    (with the prefix as a DynamicCache when prompted), then a linear 2-way classifier, cross-entropy summed."""
    bb = enc.backbone
    emb = bb.embeddings(input_ids=ids)
    if h is not None:
        emb = torch.cat([h.unsqueeze(1), emb[:, 1:]], 1)
    P = enc.prompt_length if prompted else 0
    full = torch.cat([mask.new_ones(mask.shape[0], P), mask], 1)
    additive = (1.0 - full[:, None, None, :].float()) * torch.finfo(torch.float32).min
    kw = {}
    if prompted:
        kw = {cache_keyword(bb.encoder): build_prefix_cache(enc.prompt.layer_prefixes(), ids.shape[0]),
              "use_cache": True}
    hidden = bb.encoder(emb, attention_mask=additive, **kw).last_hidden_state
    t = labels != -100
    logits = hidden[t] @ term.classifier.weight.T + term.classifier.bias
    return F.cross_entropy(logits, labels[t], reduction="sum")


@pytest.mark.parametrize("discriminator,condition", [("prompted", "after_head"), ("plain", "after_head"),
                                                     ("prompted", "none")])
def test_term_equals_plain_reference_with_gradients(tiny_bert_dir, discriminator, condition):
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3, init_std=0.5)).eval()
    tok = enc.tokenizer
    term = CRTDTerm(enc.hidden_size, RandomGenerator(tok, 0.3), WeightSchedule(0.005),
                    discriminator=discriminator, condition=condition)
    b = _batch(enc)
    ex = term.make_extras(b, torch.Generator().manual_seed(5))
    assert set(ex) == {"rtd_input_ids", "rtd_labels"}
    assert int(term.num_targets(ex)) == int((b.attention_mask.sum() - b.rows))
    h = torch.randn(b.rows, enc.hidden_size, requires_grad=True)
    got = term(enc, b.model_inputs(), ex, None if condition == "none" else h)
    params = [enc.prompt.prefix, term.classifier.weight] + ([h] if condition != "none" else [])
    if discriminator == "plain":
        params.remove(enc.prompt.prefix)
    g_got = torch.autograd.grad(got, params)
    ref = _reference(enc, term, ex["rtd_input_ids"], b.attention_mask, ex["rtd_labels"],
                     None if condition == "none" else h, discriminator == "prompted")
    g_ref = torch.autograd.grad(ref, params)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(g_got, g_ref):
        assert r.abs().sum() > 0
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


def test_positions_average_counts_every_position_of_the_padded_batch(tiny_bert_dir):
    """average="positions": the trainer divides the same sum by rows x padded length (DiffCSE's
    CrossEntropyLoss mean over e_labels.view(-1)), not by the real tokens but position 0."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3))
    b = _batch(enc)
    terms = {avg: CRTDTerm(enc.hidden_size, RandomGenerator(enc.tokenizer, 0.3), average=avg)
             for avg in ("tokens", "positions")}
    ex = terms["tokens"].make_extras(b, torch.Generator().manual_seed(5))
    assert int(terms["positions"].num_targets(ex)) == b.input_ids.numel() == b.rows * b.input_ids.shape[1]
    assert int(terms["tokens"].num_targets(ex)) == int(b.attention_mask.sum() - b.rows)
    assert b.input_ids.numel() > int(b.attention_mask.sum())  # the rows differ in length: padding counts
    with pytest.raises(ValueError, match="average must be one of tokens, positions"):
        CRTDTerm(enc.hidden_size, RandomGenerator(enc.tokenizer, 0.3), average="mean")


def test_conditional_input_matters(tiny_bert_dir):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3)).eval()
    term = CRTDTerm(enc.hidden_size, RandomGenerator(enc.tokenizer, 0.3))
    b = _batch(enc)
    ex = term.make_extras(b, torch.Generator().manual_seed(5))
    h = torch.randn(b.rows, enc.hidden_size)
    assert not torch.allclose(term(enc, b.model_inputs(), ex, h), term(enc, b.model_inputs(), ex, 2 * h))


def test_replacement_file_is_seeded_resumable_and_joins_onto_batches(tiny_bert_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    b = _batch(enc)
    sents = [b.input_ids[r, :int(b.attention_mask[r].sum())].tolist() for r in range(b.rows)]
    gen = RandomGenerator(enc.tokenizer, 0.3)
    settings = {"generator": "random", "masking_ratio": 0.3}
    whole = tmp_path / "whole.jsonl"
    assert write_replacement_file(whole, sents, gen, seed=7, settings=settings) == len(ROWS)
    part = tmp_path / "part.jsonl"
    write_replacement_file(part, sents[:2], gen, seed=7, settings=settings)
    with open(part, "ab") as f:
        f.write(b'{"ids": [2, 5')  # a torn line of a killed run
    assert write_replacement_file(part, list(reversed(sents)), gen, seed=7, settings=settings) == len(ROWS) - 2
    assert ReplacementTable(part).table == ReplacementTable(whole).table
    with pytest.raises(ValueError, match="other settings"):
        write_replacement_file(part, sents, gen, seed=8, settings=settings)
    table = ReplacementTable(whole)
    ids, labels = table.corrupt(b.input_ids, b.attention_mask)
    assert (ids != b.input_ids).any() and torch.equal(ids[~b.attention_mask.bool()],
                                                      b.input_ids[~b.attention_mask.bool()])
    term = CRTDTerm(enc.hidden_size, table)
    assert torch.equal(term.make_extras(b, torch.Generator())["rtd_labels"], labels)
    other = Collator(enc.tokenize, 32)([("an unseen sentence",)])
    with pytest.raises(ValueError, match="make-replacements"):
        table.corrupt(other.input_ids, other.attention_mask)


def test_the_conditional_input_lands_on_each_sequence_s_first_token_in_a_packed_batch(tiny_bert_dir):
    """Packed, the rows are one sequence back to back: the conditional input goes to each sequence's first token, at
    the offsets of the forward's prefix state (the ``fastprompt_state`` keyword). The term equals the padded one
    (float32, the same maths in another order: a few ulps of a sum of ~40 cross-entropies)."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(3, init_std=0.5)).eval()
    term = CRTDTerm(enc.hidden_size, RandomGenerator(enc.tokenizer, 0.3))
    b = _batch(enc)
    assert not b.attention_mask.bool().all()  # padding, so that the packed forward packs
    ex = term.make_extras(b, torch.Generator().manual_seed(5))
    h = torch.randn(b.rows, enc.hidden_size, generator=torch.Generator().manual_seed(6))
    padded = term(enc, b.model_inputs(), ex, h)
    packed = term(enc.pack_sequences(), b.model_inputs(), ex, h)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(term(enc, b.model_inputs(), ex, 2 * h), packed)

"""Collator: dynamic padding, view-major layout, max_length truncation."""
import pytest
import torch

from fastprompt.data import Collator, hf_tokenize


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


def test_unsup_rows_become_two_identical_views(tokenizer):
    rows = [("a short one",), ("a somewhat longer sentence than the first",)]
    b = Collator(hf_tokenize(tokenizer), max_length=32)(rows)
    assert b.n_views == 2 and b.batch_size == 2
    assert b.input_ids.shape[0] == 4
    assert torch.equal(b.input_ids[:2], b.input_ids[2:]) and torch.equal(b.attention_mask[:2], b.attention_mask[2:])
    # padded to the longest of the batch, not to max_length
    assert b.input_ids.shape[1] == int(b.attention_mask.sum(1).max()) < 32
    assert b.token_type_ids is not None and set(b.model_inputs()) == {"input_ids", "attention_mask", "token_type_ids"}


def test_triplets_are_view_major_and_truncated(tokenizer):
    rows = [("a0 " * 50, "p0", "n0"), ("a1", "p1", "n1")]
    b = Collator(hf_tokenize(tokenizer), max_length=8)(rows)
    assert b.n_views == 3 and b.input_ids.shape == (6, 8)
    texts = tokenizer.batch_decode(b.input_ids, skip_special_tokens=True)
    assert texts[1:] == ["a1", "p0", "p1", "n0", "n1"]


def test_bad_batches(tokenizer):
    c = Collator(hf_tokenize(tokenizer))
    with pytest.raises(ValueError, match="empty batch"):
        c([])
    with pytest.raises(ValueError, match="same number of sentences"):
        c([("a", "b"), ("c",)])
    with pytest.raises(ValueError, match="max_length"):
        Collator(hf_tokenize(tokenizer), max_length=1)
    with pytest.raises(TypeError, match="callable"):
        Collator(None)

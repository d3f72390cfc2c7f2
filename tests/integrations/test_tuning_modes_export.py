"""Exports of the tuning modes without a prompt: a LoRA checkpoint (adapters merged into the weights for the
sentence-transformers and ONNX exports, or kept as adapters without the backbone) and a fully fine-tuned one; the
PEFT prefix export refuses both with its reason.

Tolerance 1e-5 on unit-length fp32 vectors, as tests/integrations/test_sentence_transformers_export.py argues; the
merge adds one rounding per merged weight (W + (alpha/r) B A, computed in fp32: ~6e-8 relative per element), far
below it (measured: a few 1e-7).
"""
import json

import numpy as np
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

ATOL = 1e-5
SENTENCES = ["a man plays guitar on the street", "the dog", "two people sitting at a table with water .",
             "a woman is eating food in the park"]
NO_PROMPT = PromptConfig(prompt_type="none")


def _lora_encoder(tiny_bert_dir):
    torch.manual_seed(4)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=NO_PROMPT, pooler="mean")
    enc.add_lora(rank=4, alpha=8, dropout=0.1)
    with torch.no_grad():  # trained adapters (lora_B starts at zero, which would hide a lost adapter)
        for name, p in enc.backbone.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return enc.eval()


def _full_encoder(tiny_bert_dir):
    torch.manual_seed(5)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=NO_PROMPT, pooler="mean").train_backbone()
    with torch.no_grad():
        for p in enc.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return enc.eval()


def _st(folder):
    return st.SentenceTransformer(str(folder), trust_remote_code=True, device="cpu")


def test_sentence_transformers_export_merges_lora(tiny_bert_dir, tmp_path):
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    enc = _lora_encoder(tiny_bert_dir)
    expected = enc.encode(SENTENCES)
    ckpt = enc.save(tmp_path / "ckpt")
    out = export_sentence_transformers(ckpt, tmp_path / "st")
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.safetensors"))
    assert names == ["prompt/model.safetensors", "prompt/prompt.safetensors"]  # merged: plain weights, stored once
    np.testing.assert_allclose(_st(out).encode(SENTENCES), expected, atol=ATOL, rtol=0)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "with LoRA adapters merged into its weights" in card and "prefix tokens" not in card
    # without the backbone the adapters stay adapters, in PEFT's layout, added onto the named base model
    slim = export_sentence_transformers(ckpt, tmp_path / "slim", include_backbone=False)
    assert (slim / "prompt" / "adapter_model.safetensors").is_file() and not list(slim.rglob("model.safetensors"))
    np.testing.assert_allclose(_st(slim).encode(SENTENCES), expected, atol=ATOL, rtol=0)
    # an encoder in memory is exported from a merged copy: the caller's keeps its adapters
    export_sentence_transformers(enc, tmp_path / "mem")
    assert enc.lora is not None
    np.testing.assert_allclose(_st(tmp_path / "mem").encode(SENTENCES), expected, atol=ATOL, rtol=0)


def test_sentence_transformers_export_of_full_fine_tuning_without_prompt(tiny_bert_dir, tmp_path):
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    enc = _full_encoder(tiny_bert_dir)
    out = export_sentence_transformers(enc.save(tmp_path / "ckpt"), tmp_path / "st")
    np.testing.assert_allclose(_st(out).encode(SENTENCES), enc.encode(SENTENCES), atol=ATOL, rtol=0)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "(fully fine-tuned)" in card and "fully fine-tuned, trained as a sentence encoder" in card
    assert "prefix tokens" not in card


def test_merge_keeps_the_outputs(tiny_bert_dir):
    enc = _lora_encoder(tiny_bert_dir)
    before = enc.encode(SENTENCES)
    enc.merge_lora()
    assert enc.lora is None and enc.backbone_trained
    assert not any("lora_" in n for n, _ in enc.backbone.named_parameters())
    np.testing.assert_allclose(enc.encode(SENTENCES), before, atol=ATOL, rtol=0)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_onnx_export_of_the_modes(tiny_bert_dir, tmp_path, mode):
    pytest.importorskip("onnxruntime", reason="the ONNX export needs onnxruntime (pip install 'fastprompt[onnx]')")
    pytest.importorskip("onnxscript", reason="the ONNX export needs onnxscript (pip install 'fastprompt[onnx]')")
    from fastprompt.integrations.onnx import CONFIG_FILE, export_onnx

    enc = _lora_encoder(tiny_bert_dir) if mode == "lora" else _full_encoder(tiny_bert_dir)
    ckpt = enc.save(tmp_path / "ckpt")
    if mode == "lora":  # in memory: refused unmerged; the checkpoint folder is merged on load
        with pytest.raises(ValueError, match="the ONNX export takes LoRA adapters merged into the weights"):
            export_onnx(enc, tmp_path / "refused")
    out = export_onnx(ckpt, tmp_path / "onnx")
    info = json.loads((out / CONFIG_FILE).read_text())
    assert info["check"]["max_abs_diff"] < ATOL  # the graph against the (merged) encoder, in the export itself
    merged = PromptEncoder.load(ckpt).merge_lora()
    np.testing.assert_allclose(merged.encode(SENTENCES), enc.encode(SENTENCES), atol=ATOL, rtol=0)


def test_peft_prefix_export_refuses_lora_and_no_prompt(tiny_bert_dir, tmp_path):
    from fastprompt.integrations.peft import export_peft

    with pytest.raises(ValueError, match="already stores in PEFT's own layout"):
        export_peft(_lora_encoder(tiny_bert_dir).save(tmp_path / "lora"), tmp_path / "a")
    with pytest.raises(ValueError, match=r"this checkpoint has no prompt \(prompt_type: none"):
        export_peft(_full_encoder(tiny_bert_dir).save(tmp_path / "full"), tmp_path / "b")


def test_mteb_revision_tells_lora_and_fine_tuned_models_apart(tiny_bert_dir):
    """MTEB caches results by revision, the digest of the trained weights: models without a prompt differ only in
    their adapters or backbone, which the digest must include (else two runs would share one cache entry)."""
    from fastprompt.integrations.mteb import MTEBEncoder

    a, b = _lora_encoder(tiny_bert_dir), _lora_encoder(tiny_bert_dir)
    assert MTEBEncoder(a).revision == MTEBEncoder(b).revision
    with torch.no_grad():
        next(p for n, p in b.backbone.named_parameters() if "lora_B" in n).add_(0.1)
    assert MTEBEncoder(a).revision != MTEBEncoder(b).revision
    full = _full_encoder(tiny_bert_dir)
    before = MTEBEncoder(full).revision
    with torch.no_grad():
        full.backbone.embeddings.word_embeddings.weight.add_(0.1)
    assert MTEBEncoder(full).revision != before

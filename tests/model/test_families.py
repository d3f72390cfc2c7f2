"""The model families' specs (fastprompt/model/arch/): every transformers method a family replaces on the instances
it loads is pinned (its signature and a hash of its source, as the replacement was written against them). When a
transformers release changes one, these tests fail and name it, instead of the model silently running another path;
and loading refuses a backbone whose pinned signature changed."""
from __future__ import annotations

from pathlib import Path

import pytest

from fastprompt.model.arch import FAMILIES, Family, Upstream, apply, family_of

ADAPTED = sorted(t for t, f in FAMILIES.items() if f.upstreams())


@pytest.mark.parametrize("model_type", ADAPTED)
def test_the_transformers_methods_a_family_replaces_are_the_ones_it_was_written_for(model_type):
    for upstream in FAMILIES[model_type].upstreams():
        signature, sha = upstream.current()
        assert (signature, sha) == (upstream.signature, upstream.source_sha), (
            f"transformers changed {upstream.qualname} (signature {signature}, source sha {sha}; pinned "
            f"{upstream.signature}, {upstream.source_sha}): re-check fastprompt's replacement for the "
            f"{FAMILIES[model_type].family} family against the new code (its maths, the attributes it reads), run "
            "tests/model, then update the pin in fastprompt/model/arch/")


def test_the_families_adapt_what_the_code_supports_today():
    adapted = {t: (f.attention, len(f.adapters), len(f.add_norm), f.pooled_rows is not None)
               for t, f in FAMILIES.items() if f.upstreams()}
    assert adapted == {"bert": ("interface", 0, 2, True), "roberta": ("interface", 0, 2, True),
                       "xlm-roberta": ("interface", 0, 2, True), "electra": ("interface", 0, 2, True),
                       "mpnet": ("adapters", 2, 1, False), "deberta-v2": ("bypassed", 0, 2, False)}
    assert [t for t, f in FAMILIES.items() if f.refused] == ["deberta-v2"]
    # LoRA's default targets, the gated feed-forward (FLOPs) and the tested ONNX export are the families' too
    assert [t for t, f in FAMILIES.items() if not f.onnx] == ["deberta-v2"]
    assert [t for t, f in FAMILIES.items() if not f.lora_targets] == ["deberta-v2"]
    assert [t for t, f in FAMILIES.items() if f.ffn_matrices == 3] == [
        "modernbert", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"]


def test_loading_refuses_a_backbone_whose_pinned_signature_changed():
    import torch

    pinned = FAMILIES["bert"].add_norm[0]
    changed = Upstream(pinned.module, pinned.name, "(self, hidden_states)", pinned.source_sha)
    spec = Family("bert", "BERT-like encoders", add_norm=(changed,))
    with pytest.raises(RuntimeError, match="transformers changed .*BertSelfOutput.forward: its signature is now"):
        apply(spec, torch.nn.Module(), None)
    gone = Upstream(pinned.module, "NoSuchOutput", pinned.signature, pinned.source_sha)
    with pytest.raises(ImportError, match="has no class NoSuchOutput"):
        apply(Family("bert", "BERT-like encoders", add_norm=(gone,)), torch.nn.Module(), None)


def test_a_spec_is_consistent_and_an_unknown_model_type_gets_an_empty_one():
    with pytest.raises(ValueError, match="refused .* exactly when attention='bypassed'"):
        Family("x", "X", attention="bypassed")
    with pytest.raises(ValueError, match="attention must be one of"):
        Family("x", "X", attention="own")
    unknown = family_of("no-such-type")
    assert not (unknown.packs or unknown.upstreams() or unknown.peft) and "no-such-type" not in FAMILIES


def test_no_bytecode_comparison_in_the_package():
    package = Path(__file__).resolve().parents[2] / "fastprompt"
    assert not [p for p in package.rglob("*.py") if "co_code" in p.read_text(encoding="utf-8")]

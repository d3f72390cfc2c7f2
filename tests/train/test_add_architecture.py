"""docs/architectures.md's "Adding an architecture", followed literally: a model type transformers loads
(tests/train/toy_arch/model.py, registered with AutoConfig/AutoModel as a model's own package would be) and the one
module fastprompt needs for it (tests/train/toy_arch/family.py: its spec and the one registration line). Importing
that module is all it takes for ``fastprompt train`` to train a prompt on the toy model, with the fused
add + LayerNorm on the modules the spec names and packed batches equal to padded ones."""
from __future__ import annotations

import csv
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture
def toy(monkeypatch):
    from fastprompt.model.arch import unregister_family

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    model = importlib.import_module("toy_arch.model")  # the model's own package: AutoConfig/AutoModel.register
    family = importlib.import_module("toy_arch.family")  # runs its one register_family(...) line
    try:
        yield model, family
    finally:
        unregister_family(model.MODEL_TYPE)
        for name in [m for m in sys.modules if m == "toy_arch" or m.startswith("toy_arch.")]:
            del sys.modules[name]


@pytest.fixture
def toy_dir(toy, tiny_bert_dir, tmp_path) -> Path:
    """A random toy model with the tiny BERT's tokenizer, saved as a model folder."""
    model, _ = toy
    vocab = json.loads((tiny_bert_dir / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    path = tmp_path / "toy-model"
    model.ToyModel(model.ToyConfig(vocab_size=vocab)).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tiny_bert_dir / name).exists():
            shutil.copy(tiny_bert_dir / name, path / name)
    return path


def test_the_toy_family_is_applied_as_its_spec_says(toy, toy_dir):
    from fastprompt.model import PromptConfig, PromptEncoder

    _, family = toy
    assert family.OUTPUT.current() == (family.OUTPUT.signature, family.OUTPUT.source_sha)  # the pin holds
    enc = PromptEncoder.from_pretrained(str(toy_dir), prompt_config=PromptConfig(prompt_length=3, init_std=0.5))
    arch = enc.architecture
    assert arch.family.family == "Toy encoders" and arch.own_attention is None
    assert arch.fused_add_norm == 2 * enc.backbone.config.num_hidden_layers  # attention_output and output
    assert enc.packing_refusal() is None and not arch.pooled_rows_only
    # packed batches compute what padded ones do (the spec's packs=True)
    sentences = ["a man plays the guitar", "the dog", "two people sit at a big table in the park"]
    enc.double().eval()
    padded = enc.encode(sentences, normalize=False)
    packed = enc.pack_sequences().encode(sentences, normalize=False)
    # float64, the same maths in another order (the variable-length op instead of the padded one): ~1e-15
    torch.testing.assert_close(torch.from_numpy(packed), torch.from_numpy(padded), rtol=1e-10, atol=1e-10)


def test_the_toy_family_module_is_the_one_the_docs_show():
    """docs/architectures.md's recipe shows the toy's family module (its code after the docstring) verbatim."""
    import textwrap

    root = Path(__file__).resolve().parents[2]
    recipe = (root / "docs" / "architectures.md").read_text(encoding="utf-8").split("## Adding an architecture")[1]
    shown = textwrap.dedent(recipe.split("```python\n")[1].split("```")[0])
    module = (Path(__file__).parent / "toy_arch" / "family.py").read_text(encoding="utf-8")
    assert module.split('"""')[2].strip() == shown.strip()


def test_a_toy_architecture_trains_through_the_cli(toy, toy_dir, base_config, tmp_path):
    from fastprompt.cli import main

    recipe = tmp_path / "toy-arch.yaml"
    recipe.write_text(yaml.safe_dump(base_config(model=str(toy_dir), max_steps=2, log_every=1, sts_dir=None)),
                      encoding="utf-8")
    assert main(["train", "--config", str(recipe)]) == 0
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["global_step"] == 2
    rows = [r for r in csv.DictReader((run / "train_log.csv").open()) if r["loss"]]
    assert [r["step"] for r in rows] == ["1", "2"] and all(float(r["loss"]) > 0 for r in rows)

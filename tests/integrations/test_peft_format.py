"""PEFT prefix-tuning adapters, both ways; and PEFT itself running an exported adapter on a tiny encoder.

Finding (peft 0.21.2, transformers 5.23): PEFT's prefix tuning does run a BERT/RoBERTa encoder
(``PeftModelForFeatureExtraction`` prepends P ones to the mask and passes the prefix as a ``DynamicCache``), with the
tokens at positions P..P+S-1 (the model offsets positions by the cache length, and PEFT adds P to explicit
``position_ids``): the outputs equal fastprompt's with ``position_mode: shifted``.

Tolerances: fastprompt's attention path and PEFT's cache path compute the same softmax over the same keys in fp32;
on the CPU both run aten SDPA over [prefix; tokens], on other backends the fused op's fp32 reductions differ in
order only, ~1e-7 relative per layer. The compared hidden states are LayerNorm outputs of size O(1) (< 10 in the tiny
random models), so 1e-5 absolute is a 10x margin over the worst accumulated rounding.
"""
import json
import logging
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastprompt import cli
from fastprompt.integrations._common import prefix_from_rows, prefix_to_rows
from fastprompt.integrations.peft import export_peft, import_peft, read_peft_adapter
from fastprompt.model import PromptConfig, PromptEncoder

ATOL = 1e-5
SENTENCES = ["a man plays guitar on the street", "the dog", "two people sitting at a table with water ."]


def _encoder(model_dir, **config):
    torch.manual_seed(0)
    pooler = config.pop("pooler", "cls")
    return PromptEncoder.from_pretrained(model_dir, pooler=pooler,
                                         prompt_config=PromptConfig(**{"init_std": 0.5, **config})).eval()


def _hidden(encoder):
    batch = encoder.tokenize(SENTENCES)
    with torch.no_grad():
        return encoder.hidden_states(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")), batch


def test_rows_and_prefix_layout_are_inverse():
    prefix = torch.randn(3, 2, 4, 5, 6)
    rows = prefix_to_rows(prefix)
    assert rows.shape == (5, 3 * 2 * 4 * 6)
    assert torch.equal(prefix_from_rows(rows, 3, 4), prefix)
    # row p holds layer 0's key (heads x dims), then layer 0's value, then layer 1's key, ...
    assert torch.equal(rows[2, :24], prefix[0, 0, :, 2].reshape(-1))
    assert torch.equal(rows[2, 24:48], prefix[0, 1, :, 2].reshape(-1))
    assert torch.equal(rows[2, 48:72], prefix[1, 0, :, 2].reshape(-1))


@pytest.mark.parametrize("config", [{}, {"prefix_projection": True, "projection_hidden_size": 8},
                                    {"shared_across_layers": True}])
def test_fastprompt_to_peft_to_fastprompt(tiny_bert_dir, tmp_path, config):
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mask", max_length=24,
                                            template='the sentence "[X]" means [MASK] .',
                                            prompt_config=PromptConfig(prompt_length=3, init_std=0.5, **config)).eval()
    adapter = export_peft(encoder, tmp_path / "adapter")
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    back = PromptEncoder.load(import_peft(adapter, tmp_path / "back")).eval()
    assert (back.pooler.pooler, back.max_length, back.template) == ("mask", 24, encoder.template)
    assert back.prompt_config.position_mode == "standard"  # fastprompt's own setting comes back
    expected = torch.stack([torch.stack(kv) for kv in encoder.prompt.layer_prefixes()])
    if config.get("prefix_projection"):  # folded through the MLP: same prefix up to the MLP's rounding
        torch.testing.assert_close(back.prompt.prefix.data, expected, atol=1e-6, rtol=0)
    else:
        assert torch.equal(back.prompt.prefix.data, expected)
    torch.testing.assert_close(torch.as_tensor(back.encode(SENTENCES)), torch.as_tensor(encoder.encode(SENTENCES)),
                               atol=ATOL, rtol=0)


def test_peft_to_fastprompt_to_peft(tiny_bert_dir, tmp_path):
    """An adapter PEFT wrote comes back bit for bit; imported, it runs shifted as PEFT ran it."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    torch.manual_seed(0)
    config = peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=4, prefix_projection=True,
                                     encoder_hidden_size=16)
    model = peft.get_peft_model(AutoModel.from_pretrained(tiny_bert_dir), config)
    model.save_pretrained(tmp_path / "theirs")
    imported = PromptEncoder.load(import_peft(tmp_path / "theirs", tmp_path / "ours"))
    assert imported.prompt_config.position_mode == "shifted" and imported.pooler.pooler == "cls"
    export_peft(tmp_path / "ours", tmp_path / "again")
    theirs = load_file(str(tmp_path / "theirs" / "adapter_model.safetensors"))
    again = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert torch.equal(theirs["prompt_embeddings"], again["prompt_embeddings"])
    a = json.loads((tmp_path / "theirs" / "adapter_config.json").read_text())
    b = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
    for key in ("peft_type", "task_type", "num_virtual_tokens", "num_layers", "num_attention_heads", "token_dim",
                "num_transformer_submodules", "base_model_name_or_path", "inference_mode"):
        assert a[key] == b[key], key
    assert "peft_version" in a and "peft_version" in b  # PEFT records its version; export writes the layout's


@pytest.mark.parametrize("projection", [False, True])
def test_peft_runs_the_exported_adapter_like_fastprompt(tiny_model_dir, tmp_path, projection):
    """PeftModel.from_pretrained on the tiny BERT and RoBERTa: same hidden states as fastprompt (shifted)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    encoder = _encoder(tiny_model_dir, prompt_length=3, position_mode="shifted", prefix_projection=projection,
                       projection_hidden_size=8)
    export_peft(encoder, tmp_path / "adapter")
    model = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_model_dir), tmp_path / "adapter").eval()
    ours, batch = _hidden(encoder)
    with torch.no_grad():
        theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(theirs[real], ours[real], atol=ATOL, rtol=0)
    # PEFT's own view of the adapter's prefix is fastprompt's, layer by layer
    cache = model.get_prompt(batch_size=1)
    prefix = torch.stack([torch.stack(kv) for kv in encoder.prompt.layer_prefixes()])
    for layer in range(encoder.num_layers):
        torch.testing.assert_close(cache.layers[layer].keys[0], prefix[layer, 0], atol=1e-6, rtol=0)
        torch.testing.assert_close(cache.layers[layer].values[0], prefix[layer, 1], atol=1e-6, rtol=0)


def test_standard_positions_export_with_a_warning(tiny_bert_dir, tmp_path, caplog):
    """PEFT runs every prefix shifted: a standard-position prompt gets fastprompt's shifted outputs there."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    encoder = _encoder(tiny_bert_dir, prompt_length=3)
    with caplog.at_level(logging.WARNING, logger="fastprompt.integrations.peft"):
        export_peft(encoder, tmp_path / "adapter")
    assert "positions shifted by the prompt length" in caplog.text
    model = peft.PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_bert_dir), tmp_path / "adapter").eval()
    standard, batch = _hidden(encoder)
    encoder.prompt_config.position_mode = "shifted"
    shifted, _ = _hidden(encoder)
    with torch.no_grad():
        theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(theirs[real], shifted[real], atol=ATOL, rtol=0)
    assert (theirs[real] - standard[real]).abs().max() > 1e-2


def test_pickled_adapter_is_read_with_weights_only(tiny_bert_dir, tmp_path, capfd):
    encoder = _encoder(tiny_bert_dir, prompt_length=2, position_mode="shifted")
    adapter = export_peft(encoder, tmp_path / "adapter")
    rows = load_file(str(adapter / "adapter_model.safetensors"))["prompt_embeddings"]
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({"prompt_embeddings": rows}, adapter / "adapter_model.bin")
    _, prefix, metadata = read_peft_adapter(adapter)
    assert metadata is None and torch.equal(prefix_to_rows(prefix), rows)

    class Payload:  # what an attacker would pickle: weights_only must refuse to rebuild it
        def __reduce__(self):
            return (print, ("pwned",))

    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"prompt_embeddings": Payload()}))
    with pytest.raises(ValueError, match="could not be read as plain tensors"):
        read_peft_adapter(adapter)
    assert "pwned" not in capfd.readouterr().out


@pytest.mark.parametrize("case, message", [
    ("cls_prompt", "cannot hold a \\[CLS\\] prompt"),
    ("input_layer_only", "input-layer-only prompt"),
    ("head_always", "pooler head"),
])
def test_export_refuses_what_peft_cannot_hold(tiny_bert_dir, tmp_path, case, message):
    kwargs = {"cls_prompt": {"cls_prompt": True}, "input_layer_only": {"input_layer_only": True},
              "head_always": {}}[case]
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, mlp="always" if case == "head_always" else "none",
                                            prompt_config=PromptConfig(prompt_length=2, **kwargs))
    with pytest.raises(ValueError, match=message):
        export_peft(encoder, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_import_errors_are_clear(tiny_bert_dir, tmp_path, capsys):
    encoder = _encoder(tiny_bert_dir, prompt_length=2, position_mode="shifted")
    good = export_peft(encoder, tmp_path / "good")
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    wrong = export_peft(encoder, tmp_path / "wrong")
    config = json.loads((wrong / "adapter_config.json").read_text())
    (wrong / "adapter_config.json").write_text(json.dumps({**config, "num_virtual_tokens": 5}))
    no_key = export_peft(encoder, tmp_path / "no_key")
    save_file({"something": torch.zeros(2, 2)}, str(no_key / "adapter_model.safetensors"))
    capsys.readouterr()
    cases = [(lora, "only prefix-tuning adapters"), (wrong, "the adapter config says (5,"),
             (no_key, "no 'prompt_embeddings' tensor"), (tmp_path / "missing", "not found")]
    for folder, message in cases:
        assert cli.main(["import", "--from", "peft", "--checkpoint", str(folder),
                         "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert "fastprompt import: error:" in err and message in err, err
    assert cli.main(["import", "--from", "peft", "--checkpoint", str(good), "--output", str(tmp_path / "out"),
                     "--pooler", "mean"]) == 0
    assert PromptEncoder.load(tmp_path / "out").pooler.pooler == "mean"


def test_export_cli_writes_an_adapter(tiny_bert_dir, tmp_path, capsys):
    ckpt = _encoder(tiny_bert_dir, prompt_length=2, position_mode="shifted").save(tmp_path / "ckpt")
    assert cli.main(["export", "--prompt", str(ckpt), "--to", "peft", "--output", str(tmp_path / "adapter")]) == 0
    assert "wrote peft model" in capsys.readouterr().out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "PREFIX_TUNING" and config["num_virtual_tokens"] == 2
    assert config["base_model_name_or_path"] == str(tiny_bert_dir)
    # --overwrite reaches both directions: a folder holding other files is replaced only with it
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("user data")
    capsys.readouterr()
    for argv in (["export", "--prompt", str(ckpt), "--to", "peft"], ["import", "--from", "peft", "--checkpoint",
                                                                     str(tmp_path / "adapter")]):
        assert cli.main([*argv, "--output", str(taken)]) == 2
        assert "notes.txt" in capsys.readouterr().err and (taken / "notes.txt").is_file()
        assert cli.main([*argv, "--output", str(taken), "--overwrite"]) == 0
        assert not (taken / "notes.txt").exists()
        (taken / "notes.txt").write_text("user data")


def _fine_tuned(model_dir, **config):
    """A shifted prompt on a backbone that train_backbone changed (its weights no longer the base model's)."""
    encoder = _encoder(model_dir, prompt_length=3, position_mode="shifted", **config).train_backbone()
    with torch.no_grad():
        for p in encoder.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return encoder.eval()


def test_fine_tuned_backbone_adapter_names_the_checkpoint_folder(tiny_bert_dir, tmp_path, caplog):
    """The prefix belongs to the fine-tuned backbone: the adapter names the checkpoint folder (which holds it in the
    Hugging Face layout), so PEFT on that base gives fastprompt's outputs; on the original base it would not."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    encoder = _fine_tuned(tiny_bert_dir)
    ckpt = encoder.save(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="fastprompt.integrations.peft"):
        adapter = export_peft(ckpt, tmp_path / "adapter")
    assert "holds a fine-tuned backbone" in caplog.text
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(ckpt.resolve())
    ours, batch = _hidden(encoder)
    real = batch["attention_mask"].bool()
    outputs = {}
    models = {"checkpoint": peft.AutoPeftModelForFeatureExtraction.from_pretrained(adapter),  # loads the named base
              "original": peft.PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_bert_dir), adapter)}
    for name, model in models.items():
        with torch.no_grad():
            outputs[name] = model.eval()(input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"]).last_hidden_state[real]
    torch.testing.assert_close(outputs["checkpoint"], ours[real], atol=ATOL, rtol=0)
    assert (outputs["original"] - ours[real]).abs().max() > 1e-2  # what naming the original base gave
    # and back: the adapter's base (the checkpoint folder) carries the fine-tuned backbone into fastprompt
    back = PromptEncoder.load(import_peft(adapter, tmp_path / "back")).eval()
    torch.testing.assert_close(_hidden(back)[0][real], ours[real], atol=ATOL, rtol=0)


def test_fine_tuned_encoder_object_is_refused(tiny_bert_dir, tmp_path):
    with pytest.raises(ValueError, match=r"save the encoder first"):
        export_peft(_fine_tuned(tiny_bert_dir), tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


def test_adapter_records_peft_version_and_peft_loads_it_for_inference_only(tiny_bert_dir, tmp_path):
    """PEFT refuses to load a prompt-learning adapter as trainable: the docs send training back to fastprompt."""
    from fastprompt.integrations.peft import PEFT_FORMAT_VERSION

    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    adapter = export_peft(_encoder(tiny_bert_dir, prompt_length=2, position_mode="shifted"), tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["peft_version"] == PEFT_FORMAT_VERSION
    with pytest.raises(ValueError, match="Cannot set a prompt learning adapter to trainable"):
        peft.PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_bert_dir), adapter, is_trainable=True)


def test_export_replaces_only_an_earlier_export(tiny_bert_dir, tmp_path):
    encoder = _encoder(tiny_bert_dir, prompt_length=2, position_mode="shifted")
    ckpt = encoder.save(tmp_path / "ckpt")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="is not empty and is not an earlier PEFT adapter export"):
        export_peft(encoder, taken)
    assert (taken / "notes.txt").read_text() == "user data"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="it is a file"):
        export_peft(encoder, tmp_path / "file")
    with pytest.raises(ValueError, match="is the input folder"):
        export_peft(ckpt, ckpt, overwrite=True)
    assert (ckpt / "prompt.safetensors").is_file()
    adapter = export_peft(encoder, tmp_path / "adapter")
    export_peft(ckpt, adapter)  # an earlier export of fastprompt is replaced
    export_peft(encoder, taken, overwrite=True)
    assert sorted(p.name for p in taken.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    (tmp_path / "empty").mkdir()
    export_peft(encoder, tmp_path / "empty")


def test_export_does_not_replace_an_adapter_peft_wrote(tiny_bert_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModel

    config = peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=2)
    peft.get_peft_model(AutoModel.from_pretrained(tiny_bert_dir), config).save_pretrained(tmp_path / "theirs")
    with pytest.raises(FileExistsError, match="not an earlier PEFT adapter export"):
        export_peft(_encoder(tiny_bert_dir, prompt_length=2), tmp_path / "theirs")


def test_import_takes_the_base_model_from_the_adapter_config(tiny_bert_dir, tmp_path):
    """base_model_name_or_path (what PEFT loads and users edit) wins over fastprompt's metadata, which is the
    fallback when the config names none."""
    import shutil

    encoder = _encoder(tiny_bert_dir, prompt_length=2, position_mode="shifted")
    adapter = export_peft(encoder, tmp_path / "adapter")
    moved = shutil.copytree(tiny_bert_dir, tmp_path / "moved-base")
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "base_model_name_or_path": str(moved)}))
    assert PromptEncoder.load(import_peft(adapter, tmp_path / "a")).base_model == str(moved)
    config_file.write_text(json.dumps({**config, "base_model_name_or_path": None}))
    assert PromptEncoder.load(import_peft(adapter, tmp_path / "b")).base_model == str(tiny_bert_dir)
    with pytest.raises(ValueError, match="is the input folder"):  # even with overwrite: it would be replaced
        import_peft(adapter, adapter, overwrite=True)

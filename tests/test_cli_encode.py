"""``fastprompt encode``: a text file in, one embedding per line out (.npy or .safetensors)."""
import numpy as np
import pytest
import torch

from fastprompt import cli

LINES = ["A man is playing a guitar.", "Someone plays music.", "the dog runs", "two people sit at a table",
         "it"]


@pytest.fixture(scope="module")
def encoder(tiny_bert_dir):
    from fastprompt.model import PromptEncoder

    return PromptEncoder.from_pretrained(tiny_bert_dir, pooler="mean").eval()


@pytest.fixture
def input_file(tmp_path):
    path = tmp_path / "sents.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def _run(capsys, *argv):
    rc = cli.main(["encode", "--no-progress", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_encode_npy_rows_follow_lines(tmp_path, capsys, input_file, tiny_bert_dir, encoder):
    out = tmp_path / "emb.npy"
    rc, stdout, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--input", input_file,
                           "--output", out, "--batch-size", 2)
    assert rc == 0, err
    assert "wrote 5 x 32 embeddings" in stdout
    emb = np.load(out, allow_pickle=False)
    assert emb.dtype == np.float32 and emb.shape == (5, 32)
    np.testing.assert_allclose(emb, encoder.encode(LINES), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)


def test_encode_safetensors_unnormalised_with_metadata(tmp_path, capsys, input_file, tiny_bert_dir, encoder):
    from safetensors import safe_open

    out = tmp_path / "sub" / "emb.safetensors"
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes("\r\n".join(LINES).encode("utf-8"))  # CRLF and no final newline
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--input", crlf, "--output", out,
                      "--no-normalize")
    assert rc == 0, err
    with safe_open(str(out), framework="numpy") as f:
        emb, meta = f.get_tensor("embeddings"), f.metadata()
    np.testing.assert_allclose(emb, encoder.encode(LINES, normalize=False), atol=1e-5)
    assert not np.allclose(np.linalg.norm(emb, axis=1), 1.0)
    assert meta["pooler"] == "mean" and meta["normalized"] == "false" and meta["model"] == str(tiny_bert_dir)


def test_encode_with_a_prompt_checkpoint(tmp_path, capsys, input_file, tiny_bert_dir, encoder):
    import torch

    from fastprompt.model import PromptConfig, PromptEncoder

    torch.manual_seed(5)
    prompted = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=4, init_std=1.0),
                                             pooler="cls").eval()
    ckpt = prompted.save(tmp_path / "ckpt")
    out = tmp_path / "emb.npy"
    rc, _, err = _run(capsys, "--prompt", ckpt, "--input", input_file, "--output", out)  # base model from the ckpt
    assert rc == 0, err
    emb = np.load(out)
    np.testing.assert_allclose(emb, prompted.encode(LINES), atol=1e-5)
    plain_cls = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="cls").eval().encode(LINES)
    assert np.abs(emb - plain_cls).max() > 1e-3, "the prompt must reach the embeddings"
    # --pooler overrides the checkpoint's
    rc, _, err = _run(capsys, "--prompt", ckpt, "--pooler", "mean", "--input", input_file, "--output", out)
    assert rc == 0, err
    prompted.pooler.pooler = "mean"
    np.testing.assert_allclose(np.load(out), prompted.encode(LINES), atol=1e-5)


def test_attn_backend_option_reaches_the_op(tmp_path, capsys, input_file, tiny_bert_dir, monkeypatch):
    import torch

    from fastprompt.model import PromptConfig, PromptEncoder
    from fastprompt.ops import attention

    torch.manual_seed(5)
    prompted = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=4, init_std=1.0))
    ckpt = prompted.save(tmp_path / "ckpt")
    requested = []
    real = attention.resolve_backend
    monkeypatch.setattr(attention, "resolve_backend", lambda op, t, r: requested.append(r) or real(op, t, r))
    out = tmp_path / "emb.npy"
    rc, _, err = _run(capsys, "--prompt", ckpt, "--attn-backend", "reference", "--input", input_file, "--output", out)
    assert rc == 0, err
    assert requested and set(requested) == {"reference"}
    np.testing.assert_allclose(np.load(out), prompted.eval().encode(LINES), atol=1e-5)
    with pytest.raises(SystemExit) as exc:
        _run(capsys, "--prompt", ckpt, "--attn-backend", "cuda", "--input", input_file, "--output", out)
    assert exc.value.code == 2 and "invalid choice: 'cuda'" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["empty-line", "missing-input", "bad-suffix", "not-utf8", "empty-file",
                                  "output-is-a-dir", "output-under-a-file", "cuda-without-gpu", "empty-model-dir",
                                  "corrupt-prompt", "foreign-prompt", "binary-input"])
def test_encode_errors_are_clear(tmp_path, capsys, input_file, tiny_bert_dir, case):
    out = tmp_path / "emb.npy"
    model, extra = tiny_bert_dir, []
    if case == "empty-line":
        input_file.write_text("one\ntwo\n\nfour\n", encoding="utf-8")
        expect = f"{input_file}:3: empty line"
    elif case == "missing-input":
        input_file = tmp_path / "nope.txt"
        expect = f"input file not found: {input_file}"
    elif case == "bad-suffix":
        out = tmp_path / "emb.pt"
        expect = "--output must end in .npy or .safetensors"
    elif case == "not-utf8":
        input_file.write_bytes(b"ok\n\xe9t\xe9\n")
        expect = "not valid UTF-8 (line 2"
    elif case == "empty-file":
        input_file.write_text("", encoding="utf-8")
        expect = "has no sentences"
    elif case == "binary-input":
        input_file.write_bytes(b"\x7fELF\x02\x01\x01\x00\x00")
        expect = f"{input_file}: a binary file, not UTF-8 text (a NUL byte on line 1)"
    elif case == "output-is-a-dir":
        out = tmp_path / "emb.npy"
        out.mkdir()
        expect = f"--output {out} is a directory"
    elif case == "output-under-a-file":
        out = input_file / "emb.npy"
        expect = f"{input_file} is a file, not a folder"
    elif case == "cuda-without-gpu":
        if torch.cuda.is_available():
            pytest.skip("checks the message on a machine without CUDA")
        extra = ["--device", "cuda"]
        expect = "device 'cuda' requested but this PyTorch build has no CUDA support"
    elif case == "empty-model-dir":
        model = tmp_path / "model"
        model.mkdir()
        expect = f"{model} is not a Hugging Face model folder: it has no config.json (it is empty)"
    else:
        from fastprompt.model import PromptConfig, PromptEncoder

        ckpt = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(2)).save(tmp_path / "ckpt")
        if case == "corrupt-prompt":
            weights = ckpt / "prompt.safetensors"
            weights.write_bytes(weights.read_bytes()[:40])  # truncated
            expect = f"prompt weights {weights} are corrupt or not a safetensors file"
        else:
            (ckpt / "fastprompt_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
            expect = "is not a fastprompt prompt checkpoint"
        extra = ["--prompt", ckpt]
    rc, _, err = _run(capsys, "--model", model, "--input", input_file, "--output", out, *extra)
    last = err.splitlines()[-1]  # (after the model loader's progress bar, when the model was loaded)
    assert rc == 2 and last.startswith("fastprompt encode: error: ") and expect in last, err
    assert "Traceback" not in err
    assert not out.is_file()
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("suffix", [".npy", ".safetensors"])
def test_encode_full_disk_keeps_the_previous_file(tmp_path, capsys, input_file, tiny_bert_dir, monkeypatch, suffix):
    """The write fails half-way with ENOSPC: the previous output is intact, no temporary file is left, and the
    message says both."""
    import errno

    import safetensors.numpy

    out = tmp_path / f"emb{suffix}"
    out.write_bytes(b"previous embeddings")

    def full_disk(obj, path, *args, **kwargs):
        with open(path, "wb") as fh:
            fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "save", lambda path, *a, **k: full_disk(None, path))
    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--input", input_file, "--output", out)
    assert rc == 2 and "Traceback" not in err
    assert f"could not write --output {out}: No space left on device; the previous {out} is unchanged" in err, err
    assert out.read_bytes() == b"previous embeddings"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([input_file.name, out.name])
    out.unlink()
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--input", input_file, "--output", out)
    assert rc == 2 and "No space left on device; nothing was written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [input_file.name]


def test_topk_option_sets_k_of_the_topk_pooler(tmp_path, capsys, input_file, tiny_bert_dir):
    """`--pooler topk --topk K` gives PromptEncoder(pooler="topk", topk=K)'s embeddings; K changes them."""
    from transformers import AutoConfig, AutoModelForMaskedLM, AutoTokenizer

    from fastprompt.model import PromptEncoder

    mlm = tmp_path / "mlm"
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(mlm)
    torch.manual_seed(3)
    AutoModelForMaskedLM.from_config(AutoConfig.from_pretrained(tiny_bert_dir)).save_pretrained(mlm)
    out = {}
    for k in (3, 40):
        out[k] = tmp_path / f"emb-{k}.npy"
        rc, _, err = _run(capsys, "--model", mlm, "--pooler", "topk", "--topk", k, "--input", input_file,
                          "--output", out[k])
        assert rc == 0, err
    ref = PromptEncoder.from_pretrained(mlm, pooler="topk", topk=3).eval()
    np.testing.assert_allclose(np.load(out[3]), ref.encode(LINES), atol=1e-5)
    assert ref.topk == 3 and not np.allclose(np.load(out[3]), np.load(out[40]), atol=1e-3)
    # the default k is PromptBERT's 200 (Table 9): more than this tiny vocabulary holds, a clear error
    vocab = AutoConfig.from_pretrained(mlm).vocab_size
    assert vocab < 200
    rc, _, err = _run(capsys, "--model", mlm, "--pooler", "topk", "--input", input_file, "--output",
                      tmp_path / "default.npy")
    assert rc == 2 and f"topk must be an integer in [1, vocab size {vocab}], got 200" in err
    with pytest.raises(SystemExit):
        cli.main(["encode", "--model", str(mlm), "--pooler", "topk", "--topk", "0", "--input", str(input_file),
                  "--output", str(tmp_path / "x.npy")])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if ".tmp" in p.name)


@pytest.mark.parametrize("suffix", [".safetensors", ".npy"])
def test_encode_on_a_real_full_disk_is_one_line(small_disk, fill_disk, tmp_path, tiny_bert_dir, capsys, suffix):
    """A 3 MB tmpfs, filled: safetensors raised its own SafetensorError (a traceback); now the one line of the
    faked test above, and the previous file is kept."""
    sentences = tmp_path / "many.txt"
    sentences.write_text("the dog runs\na man plays guitar\n" * 200, encoding="utf-8")  # 400 x 32 floats: 51 KB
    out = small_disk / f"emb{suffix}"
    out.write_bytes(b"previous embeddings")
    filler = fill_disk()
    argv = ["--model", tiny_bert_dir, "--input", sentences, "--output", out]
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and "Traceback" not in err and "SafetensorError" not in err, err
    assert f"fastprompt encode: error: could not write --output {out}: No space left on device; the previous {out} " \
           "is unchanged" in err, err
    assert out.read_bytes() == b"previous embeddings" and not _leftovers(small_disk)
    out.unlink()
    rc, _, err = _run(capsys, *argv)  # numpy reports its short write without an errno: the free space tells
    assert rc == 2 and "No space left on device; nothing was written" in err, err
    assert sorted(p.name for p in small_disk.iterdir()) == [filler.name]


def test_encode_dim_truncates_then_normalises(tmp_path, capsys, input_file, tiny_bert_dir, encoder):
    """Matryoshka: the first D coordinates of the raw vector, re-normalised (not a prefix of the unit vector)."""
    out = tmp_path / "emb.npy"
    rc, stdout, err = _run(capsys, "--model", tiny_bert_dir, "--pooler", "mean", "--input", input_file,
                           "--output", out, "--dim", 8)
    assert rc == 0, err
    assert "wrote 5 x 8 embeddings" in stdout
    raw = encoder.encode(LINES, normalize=False)[:, :8]
    np.testing.assert_allclose(np.load(out), raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-5)
    np.testing.assert_allclose(encoder.encode(LINES, dim=8, normalize=False), raw, atol=1e-6)
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--input", input_file, "--output", out, "--dim", 33)
    assert rc == 2 and "dim=33 is more than the 32 dimensions" in err
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        encoder.encode(LINES, dim=0)


@pytest.mark.parametrize("max_length", [2, 3])
def test_max_length_without_room_for_text_is_refused(tmp_path, capsys, input_file, tiny_bert_dir, max_length):
    """``--max-length 2`` encoded every sentence as ``[CLS] [SEP]``: identical vectors, exit 0, nothing said. Now
    refused (in encode, eval and the Python API alike: PromptEncoder.tokenize checks it), no output written; 3
    leaves one token of text."""
    from fastprompt.model import PromptEncoder

    out = tmp_path / "emb.npy"
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--max-length", max_length, "--input", input_file,
                      "--output", out)
    if max_length == 3:
        assert rc == 0 and np.load(out).shape[0] == len(LINES)
        return
    assert rc != 0 and "max_length=2 leaves no room for text" in err and "set max_length >= 3" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="leaves no room for text"):
        PromptEncoder.from_pretrained(tiny_bert_dir).encode(LINES, max_length=2)

"""``fastprompt encode``: a text file in, one embedding per line out (.npy or .safetensors)."""
import numpy as np
import pytest

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


@pytest.mark.parametrize("case", ["empty-line", "missing-input", "bad-suffix", "not-utf8", "empty-file"])
def test_encode_errors_are_clear(tmp_path, capsys, input_file, tiny_bert_dir, case):
    out = tmp_path / "emb.npy"
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
    else:
        input_file.write_text("", encoding="utf-8")
        expect = "has no sentences"
    rc, _, err = _run(capsys, "--model", tiny_bert_dir, "--input", input_file, "--output", out)
    assert rc == 2 and err.startswith("fastprompt encode: error: ") and expect in err, err
    assert not out.exists()

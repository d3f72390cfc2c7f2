"""Bad input found before the first step, each with a one-line message (no traceback from deep inside)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastprompt.train import TrainConfig, Trainer

REPO = Path(__file__).resolve().parents[2]


def _never_steps(trainer, out):
    raise AssertionError("a training step ran before the bad input was reported")


def test_corrupt_sts_test_file_is_found_before_the_first_step(base_config, tiny_sts_dir, tmp_path):
    sts = tmp_path / "sts"
    shutil.copytree(tiny_sts_dir, sts)
    gs = next((sts / "STS12-en-test").glob("STS.gs.*.txt"))
    gs.write_text("4.0\nnot-a-score\n", encoding="utf-8")  # SICK/STS-B dev still fine: only the test table breaks
    with pytest.raises(ValueError, match="STS"):
        Trainer(base_config(sts_dir=str(sts)), callbacks=[_never_steps]).train()


def test_max_length_above_the_model_maximum(base_config, tiny_bert_dir):
    import json

    positions = json.loads((tiny_bert_dir / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=rf"max_length={positions + 50} is more than .* set max_length <= \d+"):
        Trainer(base_config(max_length=positions + 50), callbacks=[_never_steps]).train()


def test_output_dir_that_is_a_file_under_a_file_or_not_writable(base_config, tmp_path):
    f = tmp_path / "a-file"
    f.write_text("keep me", encoding="utf-8")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        Trainer(base_config(output_dir=str(f))).train()
    with pytest.raises(ValueError, match="is under .*a-file, which is a file"):
        Trainer(base_config(output_dir=str(f / "run"))).train()
    assert f.read_text(encoding="utf-8") == "keep me"
    with pytest.raises(ValueError, match="is not writable"):  # /sys refuses new folders, even to root
        Trainer(base_config(output_dir="/sys/fastprompt-run")).train()


@pytest.mark.parametrize("name,content", [("data.csv", os.urandom(4096)), ("model.bin", b"\x00" * 64 + b"abc\n"),
                                          ("nul.csv", b"sent0,sent1\na\x00b,c\n")])
def test_binary_train_file(base_config, tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"binary file|not valid UTF-8|not a valid CSV"):
        Trainer(base_config(train_file=str(path))).train()


def test_binary_train_file_from_the_cli_is_one_line(base_config, tmp_path):
    path = tmp_path / "data.csv"
    path.write_bytes(b"sent0,sent1\n" + b"\x00\x01\x02" * 100)
    cfg = base_config(train_file=str(path))
    res = subprocess.run([sys.executable, "-m", "fastprompt.cli", "train"] + [f"--set={k}={v}" for k, v in cfg.items()],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "a binary file, not UTF-8 text" in res.stderr.strip().splitlines()[-1]


def test_one_repeated_sentence_names_the_duplicates(base_config, tmp_path):
    path = tmp_path / "same.txt"
    path.write_text("the same sentence\n" * 100, encoding="utf-8")
    with pytest.raises(ValueError, match=r"100 rows but only 1 distinct sentence.*deduplicate"):
        Trainer(base_config(train_file=str(path))).train()


def test_eval_steps_zero_says_how_to_turn_evaluation_off():
    with pytest.raises(ValueError, match=r"eval_steps must be > 0, got 0; to turn evaluation off, leave sts_dir"):
        TrainConfig(eval_steps=0)

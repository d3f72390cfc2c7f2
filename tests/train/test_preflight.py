"""Bad input found before the first step, each with a one-line message (no traceback from deep inside)."""
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastprompt.train import TrainConfig, Trainer

REPO = Path(__file__).resolve().parents[2]


def _never_steps(trainer, out):
    raise AssertionError("a training step ran before the bad input was reported")


@pytest.mark.parametrize("corruption", ["bad-score", "truncated"])
def test_corrupt_sts_test_file_is_found_before_the_first_step(base_config, tiny_sts_dir, tmp_path, corruption):
    sts = tmp_path / "sts"
    shutil.copytree(tiny_sts_dir, sts)
    gs = next((sts / "STS12-en-test").glob("STS.gs.*.txt"))  # SICK/STS-B dev stay fine: only a test table breaks
    scores = gs.read_text(encoding="utf-8").splitlines()
    if corruption == "bad-score":
        scores[3] = "not-a-score"
        message = rf"{re.escape(str(gs))}:4: gold score 'not-a-score' is not a number"
    else:
        scores = scores[:2]
        pairs = gs.with_name(gs.name.replace("STS.gs.", "STS.input."))
        message = rf"{re.escape(str(pairs))} has 12 lines but {re.escape(str(gs))} has 2; they must match"
    gs.write_text("\n".join(scores) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
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


@pytest.mark.parametrize("name,content,message", [
    ("data.csv", b"sent0,sent1\n" + random.Random(0).randbytes(4096),
     r"a binary file, not UTF-8 text \(a NUL byte on line \d+\)"),
    ("model.bin", b"\x00" * 64 + b"abc\n", r"a binary file, not UTF-8 text \(a NUL byte on line 1\)"),
    ("nul.csv", b"sent0,sent1\na\x00b,c\n", r"a binary file, not UTF-8 text \(a NUL byte on line 2\)"),
    ("latin1.csv", "sent0,sent1\ncaf\xe9,th\xe9\n".encode("latin-1"),
     r"not valid UTF-8 \(line 2, byte 15: invalid continuation byte\)"),
    ("latin1.txt", "a sentence\ncaf\xe9 au lait\n".encode("latin-1"),
     r"1 line\(s\) are not valid UTF-8: line 2 \(byte 3\) \(re-encode the file as UTF-8, or set "
     r"on_decode_error=skip\)"),
    ("quote.csv", b'sent0,sent1\n"' + b"a" * 200_000 + b"\n",
     r"not a valid CSV file \(line \d+: field larger than field limit \(131072\)\); the training file must be"),
])
def test_binary_train_file(base_config, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": " + message):
        Trainer(base_config(train_file=str(path)), callbacks=[_never_steps]).train()


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


def test_warmup_longer_than_the_run_is_refused(base_config):
    """The learning rate stayed near 0 for the whole run, with no warning."""
    with pytest.raises(ValueError, match=r"warmup_steps=100 is not shorter than the run \(8 steps\): the learning rate "
                                         r"would still be warming up when training ends \(at 8% of learning_rate at "
                                         r"the last step\)"):
        Trainer(base_config(warmup_steps=100)).train()
    assert Trainer(base_config(warmup_steps=7, max_steps=8)).train()["global_step"] == 8


@pytest.mark.parametrize("max_length", [2, 3])
def test_max_length_without_room_for_text_is_refused(base_config, max_length):
    """Issue 40, item 9: max_length=2 made every sentence [CLS] [SEP] and trained on identical inputs without a word;
    3 leaves one token of text and trains."""
    cfg = base_config(max_length=max_length, max_steps=1)
    if max_length == 2:
        with pytest.raises(ValueError, match=r"max_length=2 leaves no room for text: .*'s tokenizer adds 2 special "
                                             r"token\(s\) to every sentence \(\[CLS\] \[SEP\]\).* set max_length >= 3"):
            Trainer(cfg, callbacks=[_never_steps]).train()
    else:
        trainer = Trainer(cfg)
        trainer.setup()
        _, (dataset, rows) = next(trainer.sampler.iter_from(0))
        assert trainer.make_batch(rows, 0, dataset).input_ids.shape[1] == 3


def test_a_template_takes_its_room_on_top_of_max_length(base_config):
    """PromptBERT: max_length counts the sentence's own tokens, the template's come on top: 2 still holds text."""
    trainer = Trainer(base_config(max_length=2, pooler="mask", max_steps=1))
    trainer.setup()
    _, (dataset, rows) = next(trainer.sampler.iter_from(0))
    batch = trainer.make_batch(rows, 0, dataset)
    assert batch.input_ids.shape[1] > 2 + 2

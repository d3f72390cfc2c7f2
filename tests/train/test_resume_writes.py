"""Resuming rewrites train_log.csv and config.yaml atomically: a crash in either write loses no history."""
import errno
from pathlib import Path

import pytest

import fastprompt.io
from fastprompt.train import Trainer


@pytest.mark.parametrize("victim", ["config.yaml", "train_log.csv"])
def test_crash_while_resume_rewrites_a_file_keeps_it_whole(base_config, monkeypatch, victim):
    cfg = base_config(max_steps=4, save_steps=2, log_every=1)
    out = Path(cfg["output_dir"])
    Trainer(dict(cfg, max_steps=3)).train()  # last/ at step 2, log rows 1-3
    before = {name: (out / name).read_bytes() for name in ("config.yaml", "train_log.csv")}
    replace = fastprompt.io.os.replace

    def crash_on_victim(src, dst):
        if Path(dst).name == victim:
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst)

    with monkeypatch.context() as m:
        m.setattr(fastprompt.io.os, "replace", crash_on_victim)
        with pytest.raises(OSError, match="No space left"):
            Trainer(cfg).train()
    assert (out / victim).read_bytes() == before[victim]
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    summary = Trainer(cfg).train()  # the resume then works, from the history kept
    assert summary["global_step"] == 4
    steps = [line.split(",")[0] for line in (out / "train_log.csv").read_text().splitlines()[1:]]
    assert steps == ["1", "2", "3", "4"]


def test_full_disk_while_writing_last_keeps_the_previous_checkpoint(base_config, monkeypatch):
    """A checkpoint write that fails (ENOSPC inside last/) says so and what survived; the run resumes from it."""
    cfg = base_config(max_steps=4, save_steps=2, log_every=1)
    out = Path(cfg["output_dir"])
    Trainer(dict(cfg, max_steps=2)).train()  # last/ at step 2
    before = {p.name: p.read_bytes() for p in (out / "last").iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr("fastprompt.train.state.save_file", full_disk)
        with pytest.raises(OSError, match=r"could not write .*last: No space left on device; the previous last is "
                                          "unchanged"):
            Trainer(cfg).train()
    assert {p.name: p.read_bytes() for p in (out / "last").iterdir()} == before
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]
    assert Trainer(cfg).train()["global_step"] == 4


def test_corrupt_training_state_is_a_clear_error(base_config):
    cfg = base_config(max_steps=4, save_steps=2)
    out = Path(cfg["output_dir"])
    Trainer(dict(cfg, max_steps=2)).train()
    state = out / "last" / "training_state.safetensors"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"training_state.safetensors is corrupt or truncated .*resume=false "
                                         "overwrite_output_dir=true"):
        Trainer(cfg).train()


def test_lengthening_a_run_on_resume_warns_that_the_schedule_moves(base_config, caplog):
    """Linear decay to 0 at the last step: a finished 4-step run continued to max_steps 8 goes from rate 0 back to
    half the peak at step 4; the user is told instead of finding it in the log."""
    cfg = base_config(max_steps=4, save_steps=2, learning_rate=1e-2)
    Trainer(cfg).train()
    with caplog.at_level("WARNING", logger="fastprompt"):
        Trainer(dict(cfg, max_steps=8)).train()
    assert "the learning-rate schedule now spans 8 steps: at step 4 the learning rate becomes 0.005 (it was 0" in \
        caplog.text


def _train_cli(capsys, cfg: dict) -> tuple[int, str]:
    from fastprompt.cli import main

    rc = main(["train", *[f"--set={k}={v}" for k, v in cfg.items()]])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("edit,message", [
    (lambda m: m["trainer"]["state"].update(global_step="abc"),
     "key 'trainer.state.global_step' must be an integer, got 'abc'"),
    (lambda m: m["trainer"]["state"].update(hacked=1), "unknown key 'trainer.state.hacked'"),
    (lambda m: m.update(scheduler=None), "key 'scheduler' must be an object, got null"),
    (lambda m: m.update(trainer=[1]), "key 'trainer' must be an object, got [1]"),
    (lambda m: m["rng"].update(python=[3, "x", None]), "key 'rng.python[1]' must be a list of integers, got 'x'"),
], ids=["global-step-abc", "extra-key", "scheduler-null", "trainer-list", "rng-python"])
def test_a_malformed_training_state_is_one_line(base_config, capsys, edit, message):
    """Each was a TypeError or AttributeError traceback on resume: now one line naming the file and the key."""
    import json

    cfg = base_config(max_steps=4, save_steps=2)
    Trainer(dict(cfg, max_steps=2)).train()
    path = Path(cfg["output_dir"]) / "last" / "training_state.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))
    rc, err = _train_cli(capsys, cfg)
    assert rc == 2 and "Traceback" not in err, err
    assert f"fastprompt train: error: training state {path}: {message}" in err, err


def test_resuming_on_changed_training_data_is_refused(base_config, tmp_path, capsys):
    """The run identity compared the path only: a file rewritten in place resumed on new sentences."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(base_config()["train_file"]).read_bytes())
    cfg = base_config(max_steps=4, save_steps=2, train_file=str(corpus))
    Trainer(dict(cfg, max_steps=2)).train()
    lines = corpus.read_text().splitlines()
    corpus.write_text("\n".join(lines[:-1] + ["a different last sentence"]) + "\n")  # same path, same row count
    rc, err = _train_cli(capsys, cfg)
    assert rc == 2 and "Traceback" not in err, err
    assert (f"was trained on other data than {corpus} holds now ({len(lines)} rows then, {len(lines)} now; their "
            "content differs): resuming would continue on other sentences") in err, err
    corpus.write_text("\n".join(lines) + "\n")  # the original content (a new mtime): resumes
    assert Trainer(cfg).train()["global_step"] == 4


def test_the_data_fingerprint_hashes_every_sentence_in_order():
    from fastprompt.data import TrainExamples
    from fastprompt.train.checkpoints import data_fingerprint

    def fp(rows):
        return data_fingerprint(TrainExamples(columns=("sent0", "sent1"), rows=rows))

    base = fp([("a", "b"), ("c", "d")])
    assert base == fp([("a", "b"), ("c", "d")]) and base["rows"] == 2
    for other in ([("a", "b"), ("d", "c")], [("c", "d"), ("a", "b")], [("ab", ""), ("c", "d")],
                  [("a", "b"), ("c", "d"), ("e", "f")]):
        assert fp(other)["sha256"] != base["sha256"], other


def test_a_real_full_disk_while_writing_last_is_one_line_and_resumes(small_disk, fill_disk, base_config, monkeypatch,
                                                                   capsys):
    """A 3 MB tmpfs fills up just before the second write of last/ (safetensors raised SafetensorError, a traceback):
    one line, exit 2, the previous last/ intact and no temporary folder left; with space again the same command
    resumes and completes."""
    from fastprompt.train.checkpoints import RunDirectory

    cfg = base_config(output_dir=str(small_disk / "run"), max_steps=4, save_steps=2, eval_steps=100, log_every=100)
    save_last, fillers = RunDirectory.save_last, []

    def fill_then_save(self, *args, **kwargs):
        if (self.last / "training_state.json").is_file() and not fillers:  # the second write
            fillers.append(fill_disk())
        return save_last(self, *args, **kwargs)

    last = small_disk / "run" / "last"
    with monkeypatch.context() as m:
        m.setattr(RunDirectory, "save_last", fill_then_save)
        rc, err = _train_cli(capsys, cfg)
    assert rc == 2 and "Traceback" not in err and "SafetensorError" not in err, err
    assert f"fastprompt train: error: could not write {last}: No space left on device; the previous last is " \
           "unchanged" in err, err
    assert not [p for p in small_disk.rglob("*") if ".tmp" in p.name]
    before = {p.name: p.read_bytes() for p in last.iterdir()}
    fillers[0].unlink()
    assert Trainer(cfg).train()["global_step"] == 4
    assert before  # last/ was whole when the next run resumed from it

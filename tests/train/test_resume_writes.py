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

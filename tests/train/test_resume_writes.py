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

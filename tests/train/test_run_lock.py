"""One run per output_dir: a second run is refused with the first one's PID; a dead run's lock is stale."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastprompt.train import Trainer, run_lock
from fastprompt.train.run_lock import LOCK_NAME, OutputDirLocked, RunLock

REPO = Path(__file__).resolve().parents[2]
_HOLD = textwrap.dedent("""
    import sys, time
    from fastprompt.train.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_trainer_on_the_same_output_dir_is_refused_with_the_first_pid(base_config):
    cfg = base_config(max_steps=2)
    first = Trainer(cfg)
    first.setup()
    with pytest.raises(OutputDirLocked, match=rf"in use by another training run \(process {os.getpid()}\)"):
        Trainer(cfg).train()
    assert first.train()["status"] == "completed"  # the refused run touched nothing of the first
    again = Trainer(cfg).train()  # the lock was released at the end of the first run
    assert again["global_step"] == 2


def test_lock_is_released_when_setup_fails(base_config, tmp_path):
    cfg = base_config(train_file=str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError):
        Trainer(cfg).train()
    with RunLock(cfg["output_dir"]):  # free again
        pass


def test_cli_refuses_a_live_run_and_takes_over_a_killed_ones_lock(base_config, tmp_path):
    cfg = base_config(max_steps=1)
    out = Path(cfg["output_dir"])
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = [sys.executable, "-m", "fastprompt.cli", "train"] + [f"--set={k}={v}" for k, v in cfg.items()]
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"in use by another training run (process {holder.pid})" in res.stderr
        assert "Traceback" not in res.stderr
        assert not (out / "train_log.csv").exists()
    finally:
        holder.kill()  # SIGKILL: the lock file stays behind, with a dead PID in it
        holder.wait(30)
    assert (out / LOCK_NAME).read_text().strip() == str(holder.pid)
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_exclusive_create_fallback_detects_stale_locks(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "fcntl", None)
    (tmp_path / LOCK_NAME).write_text(f"{_dead_pid()}\n")
    lock = RunLock(tmp_path).acquire()  # the stale file is taken over
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    with pytest.raises(OutputDirLocked, match=f"process {os.getpid()}"):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    with RunLock(tmp_path):
        pass

"""One run per output_dir: a second run is refused with the first one's PID; a dead run's lock is stale."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastprompt.train import Trainer
from fastprompt.train.run_lock import LOCK_NAME, OutputDirLocked, RunLock

REPO = Path(__file__).resolve().parents[2]
_HOLD = textwrap.dedent("""
    import sys, time
    from fastprompt.train.run_lock import RunLock
    lock = RunLock(sys.argv[1]).acquire()
    print("locked", flush=True)
    time.sleep(600)
""")


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


@pytest.mark.heavy  # training processes started and killed
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


_NO_FLOCK = textwrap.dedent("""
    import errno
    import filelock._unix
    def no_flock(fd):
        raise OSError(errno.ENOSYS, "flock not supported")
    filelock._unix.lock_fd_nonblocking = no_flock
""")


def test_without_flock_a_killed_runs_marker_is_stale(tmp_path, monkeypatch):
    """On a file system without flock (ENOSYS), filelock falls back to a marker file naming its holder: a marker
    left by a run killed with SIGKILL is taken over, a live holder is named in the refusal."""
    import errno
    import warnings

    import filelock._unix

    def no_flock(fd):
        raise OSError(errno.ENOSYS, "flock not supported")

    monkeypatch.setattr(filelock._unix, "lock_fd_nonblocking", no_flock)  # the same patch in this process
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-W", "ignore", "-c", _NO_FLOCK + _HOLD, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flock not supported on this filesystem, falling back"
            with pytest.raises(OutputDirLocked, match=f"process {holder.pid}"):
                RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(30)
    assert (tmp_path / LOCK_NAME).exists()  # the dead run's marker
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lock = RunLock(tmp_path).acquire()  # the stale marker is taken over
        with pytest.raises(OutputDirLocked, match=f"process {os.getpid()}"):
            RunLock(tmp_path).acquire()
        lock.release()
        with RunLock(tmp_path):
            pass

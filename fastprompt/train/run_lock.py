"""One training run per output folder: an exclusive lock on ``<output_dir>/.fastprompt.lock``, a ``filelock.FileLock``.

Two runs writing the same folder would interleave ``train_log.csv`` rows and overwrite each other's checkpoints.
``filelock`` takes an OS lock on the file (``flock`` on POSIX, ``msvcrt.locking`` on Windows) that the kernel releases
when its owner exits, however it exits (SIGKILL included), so a lock file left by a dead run is stale by
construction and the next run simply takes it; on a file system without ``flock`` it falls back to a marker file
naming its holder, which a later run removes once that process is gone. The holder of an OS lock writes its PID
into the file for the message a second run gets (the marker names it already). At release the file is emptied,
not deleted: unlinking a locked file would let a third run lock a new inode while a second still holds the old one.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import filelock

LOCK_NAME = ".fastprompt.lock"


class OutputDirLocked(RuntimeError):
    """Another live process is training into the same ``output_dir``."""


def _read_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(path.read_text(encoding="ascii").split()[0])
    return None


class RunLock:
    """``RunLock(output_dir).acquire()`` ... ``release()`` (or ``with RunLock(d):``)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.root = Path(output_dir)
        self.path = self.root / LOCK_NAME
        self._lock: filelock.BaseFileLock | None = None

    @property
    def held(self) -> bool:
        return self._lock is not None

    def acquire(self) -> "RunLock":
        if self._lock is not None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        # thread_local=False: the Trainer may release from another thread than the one that acquired
        lock = filelock.FileLock(self.path, timeout=0, thread_local=False)
        try:
            lock.acquire()
        except filelock.Timeout:
            pid = _read_pid(self.path)
            who = f"process {pid}" if pid is not None else "another process"
            raise OutputDirLocked(f"{self.root} is in use by another training run ({who}); wait for it to finish, "
                                  "stop it, or choose another output_dir") from None
        self._lock = lock
        if not isinstance(lock, filelock.SoftFileLock):  # a marker file already names its holder
            self.path.write_text(f"{os.getpid()}\n", encoding="ascii")
        return self

    def release(self) -> None:
        if self._lock is None:
            return
        lock, self._lock = self._lock, None
        if not isinstance(lock, filelock.SoftFileLock):
            with contextlib.suppress(OSError):
                self.path.write_bytes(b"")
        lock.release()

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()

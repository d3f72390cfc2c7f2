"""One training run per output folder: an exclusive lock on ``<output_dir>/.fastprompt.lock``.

Two runs writing the same folder would interleave ``train_log.csv`` rows and overwrite each other's
checkpoints. The lock is ``fcntl.flock`` on a file that holds the owner's PID (for the error message): the
kernel releases a flock when its owner exits, however it exits (SIGKILL included), so a lock file left by
a dead run is stale by construction and the next run simply takes it. Platforms without ``fcntl`` fall back
to an ``O_EXCL`` create of the same file, where a stale file (its PID no longer running) is removed and
retaken.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LOCK_NAME = ".fastprompt.lock"


class OutputDirLocked(RuntimeError):
    """Another live process is training into the same ``output_dir``."""


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _read_pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text(encoding="ascii").split()[0])
    return None


def _locked_message(root: Path, pid: int | None) -> str:
    who = f"process {pid}" if pid is not None else "another process"
    return (f"{root} is in use by another training run ({who}); wait for it to finish, stop it, or choose "
            "another output_dir")


class RunLock:
    """``RunLock(output_dir).acquire()`` ... ``release()`` (or ``with RunLock(d):``)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.root = Path(output_dir)
        self.path = self.root / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        if self._fd is not None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        self._fd = self._acquire_flock() if fcntl is not None else self._acquire_exclusive()
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode("ascii"))
        return self

    def _acquire_flock(self) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputDirLocked(_locked_message(self.root, _read_pid(self.path))) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _acquire_exclusive(self) -> int:
        for _ in range(2):
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                pid = _read_pid(self.path)
                if pid is not None and _pid_alive(pid):
                    raise OutputDirLocked(_locked_message(self.root, pid)) from None
                self.path.unlink(missing_ok=True)  # stale: its run is gone
        raise OutputDirLocked(_locked_message(self.root, _read_pid(self.path)))

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        # Emptied rather than deleted: unlinking a flocked file would let a third run lock a new inode while
        # a second one still holds the old one.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        if fcntl is None:
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(fd)  # releases the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()

"""Crash-safe file output shared by checkpoints and training state, and the checked reading of input files.

A file fastprompt writes whole goes through :func:`atomic_file` (:func:`write_text_atomic` and
:func:`write_json_atomic` on top of it), a folder through :func:`atomic_directory` (append-only logs and JSONL
stores grow in place instead). Readers only ever see a complete file or directory: content is written into a
hidden sibling, flushed to disk, then swapped in with renames. An interrupted write leaves the previous version
untouched (at worst parked at ``.<name>.old`` for the instant between the two renames; :func:`recover_directory`
puts it back).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

#: The largest JSON file :func:`read_json` reads: every JSON file fastprompt reads (a checkpoint's config, a
#: training state, a model's config.json, metadata) is a few kilobytes, so anything near this is not one of them.
MAX_JSON_BYTES = 16 << 20


def _fsync_dir(path: Path):
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    """Delete a folder tree, a file or a link (not what it points to); nothing if absent."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class WriteError(OSError):
    """A failed atomic write: the errno and strerror of its cause (``No space left on device``), and a message that
    says what was kept. A write nested in another (a checkpoint inside ``last/``) reports its cause, not itself."""

    def __init__(self, message: str, cause: OSError):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.message = message

    def __str__(self) -> str:
        return self.message


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def as_os_error(exc: BaseException, folder: str | os.PathLike | None = None) -> OSError | None:
    """``exc`` as an OSError: itself, or a safetensors error that wraps one (safetensors' Rust code reports a full
    disk as ``SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')``, not as
    an OSError); None for any other error. A short write without an errno (numpy's ``12800 requested and 992
    written``) into ``folder`` whose file system has no space left is reported as ENOSPC, which it is."""
    if isinstance(exc, OSError):
        if exc.errno is None and folder is not None:
            with contextlib.suppress(OSError):
                if shutil.disk_usage(folder).free < (1 << 20):
                    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return exc
    found = _OS_ERROR.search(str(exc)) if type(exc).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def recover_directory(path: str | os.PathLike) -> Path:
    """If a swap was interrupted between its two renames, restore the previous complete version."""
    path = Path(path)
    old = path.parent / f".{path.name}.old"
    if not path.exists() and old.exists():
        os.replace(old, path)
    return path


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike):
    """Yield a temporary directory; on success it atomically replaces ``path``.

    On an exception (including KeyboardInterrupt) the temporary directory is removed and ``path`` is
    left exactly as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    old = path.parent / f".{path.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if os.path.lexists(path):
            _remove(old)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        _remove(old)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        os_error = as_os_error(exc, path.parent)
        if os_error is not None and os_error.errno is not None:  # a full disk, a permission error: say what is kept
            kept = (f"the previous {path.name} is unchanged" if os.path.lexists(path) or os.path.lexists(old)
                    else "nothing was written")
            raise WriteError(f"could not write {path}: {os_error.strerror or os_error}; {kept}", os_error) from exc
        raise


def check_output_file(path: str | os.PathLike, what: str = "output") -> Path:
    """ValueError unless ``path`` can become a file: not an existing folder, not under a file. Call it before
    expensive work, so that a bad output path fails at once."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file path inside it, e.g. {path / 'out'}")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what} {path} cannot be created: {parent} is a file, not a folder")
            break
    return path


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():  # relative paths, symlinks
        return True
    try:
        return os.path.samefile(a, b)  # hard links
    except OSError:  # one does not exist
        return False


def check_apart(output: str | os.PathLike, inputs, what: str = "--output") -> None:
    """ValueError when the file or folder ``output`` is one of ``inputs`` (also through a symlink, a relative path or
    a hard link), holds one (replacing the folder would delete it) or lies inside one (writing would change it).
    Call it before anything is opened for writing; ``None`` inputs are skipped."""
    out = Path(output)
    for src in inputs:
        if src is None:
            continue
        src = Path(src)
        kind = "folder" if src.is_dir() else "file"
        if _same(out, src):
            raise ValueError(f"{what} {output} is the input {kind} {src}; choose another {what}")
        if out.resolve() in src.resolve().parents:
            raise ValueError(f"{what} {output} holds the input {kind} {src}, which replacing it would delete; "
                             f"choose another {what}")
        if src.resolve() in out.resolve().parents:
            raise ValueError(f"{what} {output} is inside the input {kind} {src}, which writing there would change; "
                             f"choose another {what}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, what: str = "output"):
    """Yield a temporary path next to ``path`` (``.<name>.tmp-<pid><suffix>``: hidden, and with the suffix that
    writers such as ``numpy.save`` go by); on success it is flushed to disk and atomically replaces ``path``.

    On any failure the temporary file is removed and ``path`` is left as it was; an OSError (disk full,
    permission denied, ...) is re-raised as one whose message says so, with the original as its cause.
    """
    path = check_output_file(path, what)
    existed = path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}{path.suffix}"
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        os_error = as_os_error(exc, path.parent)
        if os_error is not None:
            kept = f"the previous {path} is unchanged" if existed else "nothing was written"
            raise WriteError(f"could not write {what} {path}: {os_error.strerror or os_error}; {kept}", os_error) \
                from exc
        raise


def write_text_atomic(path: str | os.PathLike, text: str, what: str = "output") -> None:
    """Write UTF-8 ``text`` to ``path`` (newlines as given) through :func:`atomic_file`: readers see the old file or
    the new one, never a half-written one."""
    with atomic_file(path, what) as tmp, open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)


def write_json_atomic(path: str | os.PathLike, data, what: str = "output") -> None:
    """Write ``data`` as indented JSON with sorted keys to ``path`` through :func:`atomic_file`."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", what)


_KINDS = ((stat.S_ISCHR, "a character device (a terminal, /dev/zero, ...)"), (stat.S_ISFIFO, "a pipe"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISBLK, "a block device"))


def check_file(path: str | os.PathLike, what: str = "file") -> Path:
    """``path`` when it is a regular file (or a link to one); otherwise an error that says what it is: missing, a
    directory, a broken link or a link loop, a device or a pipe (``/dev/stdin`` fed by a pipe). fastprompt reads
    only regular files, which have a size it can check and can be read twice."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if path.is_symlink():
            raise FileNotFoundError(f"{what} {path} is a broken symbolic link (to {os.readlink(path)}, "
                                    "which does not exist)") from None
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(f"{what} {path} is a symbolic link loop: following it never reaches a file") from None
        raise OSError(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{what} {path} is a directory, not a file")
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise ValueError(f"{what} {path} is {kind}, not a regular file; fastprompt reads files on disk only (save "
                         "the data to a file first)")
    return path


def read_json(path: str | os.PathLike, what: str = "file", schema: type | None = None) -> dict:
    """Read a JSON object with clear errors for a missing, oversized or corrupt file; with ``schema`` (a dataclass
    of :mod:`fastprompt.schema`), also check every key's type, so that a bad file is one line naming it."""
    path = check_file(path, what)
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{what} {path} is {size} bytes, more than the {MAX_JSON_BYTES >> 20} MiB any of "
                         "fastprompt's JSON files has; it is not one of them")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} {path} is corrupt (not valid UTF-8 JSON): {exc}") from exc
    except RecursionError:
        raise ValueError(f"{what} {path} is nested too deeply to be one of fastprompt's JSON files") from None
    if schema is not None:
        from fastprompt.schema import check_json

        return check_json(data, schema, f"{what} {path}")
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} is not a JSON object")
    return data


def reject_binary(data: bytes, path: str | os.PathLike, first_line: int = 1) -> None:
    """ValueError when ``data`` holds a NUL byte, which no text file has: the file is binary (an archive, a
    tensor file, ...), whose bytes may still decode as UTF-8. ``first_line``: the line number ``data`` starts at."""
    at = data.find(b"\x00")
    if at >= 0:
        line_no = first_line + data[:at].count(b"\n")
        raise ValueError(f"{path}: a binary file, not UTF-8 text (a NUL byte on line {line_no})")


def read_utf8_text(path: str | os.PathLike, what: str = "file", *, encoding: str = "utf-8",
                   max_bytes: int | None = None) -> str:
    """The text of a UTF-8 file, with clear errors for a missing file (or one that is no regular file, see
    :func:`check_file`), one larger than ``max_bytes``, a binary one and bytes that are not UTF-8 (naming the
    line). ``encoding="utf-8-sig"`` also drops a byte-order mark."""
    path = check_file(path, what)
    if max_bytes is not None and path.stat().st_size > max_bytes:
        raise ValueError(f"{what} {path} is {path.stat().st_size} bytes, more than the {max_bytes} it may have")
    data = path.read_bytes()
    reject_binary(data, path)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        line_no = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: not valid UTF-8 (line {line_no}, byte {e.start}: {e.reason})") from None


def read_utf8_lines(path: str | os.PathLike, what: str = "file") -> list[str]:
    """UTF-8 lines without their terminators (``\\n`` or ``\\r\\n``), with the errors of :func:`read_utf8_text`."""
    text = read_utf8_text(path, what)
    # Split on "\n" only: str.splitlines() would also break lines at \x85, \u2028, ... inside a sentence.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def drop_torn_tail(path: Path) -> int:
    """Cut ``path`` back to its last ``\\n`` (the end of its last complete line); the number of bytes dropped."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "r+b") as f:
        pos, block = size, 1 << 16
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            chunk = f.read(pos - start)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            pos = start
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return size - keep

"""Faults of the environment, told apart from faults of the code, and atomic writes (docs/FAULTS.md).

`pocketlora` exits 2 for a fault of its inputs or its command line (the one-line message names the file
and the fix; running the same command again fails the same way), and 3 for a fault of the environment
it writes to: no space left, quota, a read-only or unwritable output. Freeing space (or fixing the
permission) and running the same command again then finishes the work: gen starts over (it never leaves
a half bundle), train resumes from its last good checkpoint. Anything else is a bug and keeps its traceback.

Writes that a reader may see go through `write_atomic` (a temporary beside the target, fsync, rename):
a full disk or a kill leaves the previous file or the new one, never a torn one. Native writers (ORT's
checkpoint) report a failed write as a RuntimeError whose text carries the errno; `native_writes` turns
that back into the OSError it is.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
from pathlib import Path


class InputError(ValueError):
    """An input file that cannot be used; the message names it and the fix (exit 2)."""


class StageFailed(RuntimeError):
    """A stage run as its own `pocketlora` process failed with exit 2 or 3 and has printed its one-line error;
    the parent ends with the same code and one line of its own."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def read_json(path: str | os.PathLike):
    """A JSON input file, or InputError naming it."""
    try:
        return json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc}). It is damaged or incomplete: copy it again.") from exc


ENVIRONMENT = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large for the file system",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}
FREE_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def environment_fault(exc: BaseException) -> str | None:
    """'<what> (<file>)' for an OSError of the environment, else None (not one: let it raise)."""
    if not isinstance(exc, OSError) or exc.errno not in ENVIRONMENT:
        return None
    where = exc.filename or _path_in(str(exc))
    return ENVIRONMENT[exc.errno] + (f" writing {where}" if where and exc.errno in FREE_SPACE
                                     else f": {where}" if where else "")


def fix_hint(exc: OSError) -> str:
    if exc.errno in FREE_SPACE:
        return "free some space"
    if exc.errno == errno.EROFS:
        return "make that file system writable (or write somewhere else)"
    return "fix the permissions of that path (or write somewhere else)"


def _path_in(text: str) -> str | None:
    m = re.search(r"(?:to file|file):\s*(\S+?)[.,]?(?:\s|$)", text)
    return m.group(1) if m else None


def os_error_from_native(exc: BaseException, path: str | os.PathLike | None = None) -> OSError | None:
    """The OSError behind a native library's failed write, e.g. ORT's 'ToFile Failed to save checkpoint
    to file: ... error:No space left on device errno:28'; None if the text names no errno."""
    m = re.search(r"errno:\s*(\d+)|Os \{ code: (\d+)|\(os error (\d+)\)", str(exc))  # ORT's C++; Rust's io::Error
    if not m:
        return None
    code = int(next(g for g in m.groups() if g))
    return OSError(code, os.strerror(code), os.fspath(path) if path is not None else _path_in(str(exc)))


@contextlib.contextmanager
def native_writes(path: str | os.PathLike):
    """Within: a native library's error that reports an errno is raised as that OSError (for `path`);
    any other error stands as it is."""
    try:
        yield
    except Exception as exc:        # native libraries raise their own types (RuntimeError, SafetensorError)
        err = os_error_from_native(exc, path)
        if err is None:
            raise
        raise err from exc


def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write `path` whole or not at all: temp file in the same directory, fsync, rename. On failure the
    temp file is removed (it would hold the space a rerun needs) and the previous `path` is intact."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc    # a buffered write's names no file
        raise
    return path

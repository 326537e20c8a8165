"""Writing files so that a crash, a full disk or a read-only directory leaves them usable.

Every failure to write is raised as `OutputError`, one line naming the path and what to
do, which `jetserve batch` prints as is (exit status 2). Writes go through `os.write` on
an unbuffered descriptor, so nothing is left in a buffer to reach the file later, after
the error was handled; a replacement file is written next to the original, fsync'd and
renamed over it, so a reader sees the old file or the new one, never a mix.
"""

from __future__ import annotations

import errno
import os


class OutputError(OSError):
    """An output file could not be written; the message names it and the way out."""


def describe(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return f"{e.strerror or e}{f' ({name})' if name else ''}"


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may take only part)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str) -> None:
    """Makes a new or renamed directory entry survive a crash (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def replace_atomically(path: str, data: bytes, *, suffix: str) -> None:
    """Replaces `path` with `data`: a temporary file `path + suffix` in the same directory
    (a rename is atomic only within one filesystem), fsync'd, then renamed over it."""
    tmp = path + suffix
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OutputError(f"cannot rewrite {path} (via {tmp}): {describe(e)}; {path} "
                          "is unchanged") from None
    fsync_dir(os.path.dirname(os.path.abspath(path)))

"""The output file as a journal: rows appended and fsync'd, read back to resume.

A row is on disk before the job counts it done: `append` writes complete lines (each
ending in a newline) with one `write` and then `os.fsync`, so after a SIGKILL or power
loss the file holds every row appended so far, plus at most one torn line at the end (a
write cut short). `recover` truncates that torn line and returns the keys of the rows
that are there, so `--resume` runs only the rest and every input row ends up in the file
exactly once. `--retry-failed` also rewrites the file without its error rows (a new file
renamed over the old: a crash leaves one or the other), so those rows run again.

A row's key is what identifies its input row: the id (canonical JSON, see rows.id_key)
for rows that have a usable id, and "#line N" for error rows about input lines without
one (not JSON, no id) or with a duplicate id; those carry `"line": N`.

Used by one thread (the batch runner's main thread); nothing here is shared.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from jetserve.batch.rows import id_key


def line_key(line: int) -> str:
    return f"#line {line}"


def output_key(row: dict) -> str:
    """The key of an output row (see the module docstring)."""
    if "line" in row:
        return line_key(row["line"])
    return id_key(row["id"])


def part_path(output: str, process_id: int, num_processes: int) -> str:
    """Where process I of N writes when the processes run independently."""
    return f"{output}.part-{process_id}-of-{num_processes}"


def read_rows(path: str) -> list[dict]:
    """Every row of a finished output file (no torn line allowed)."""
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n} is not a JSON row ({e.msg}); was the job "
                                 "killed? run it again with --resume first") from None
            rows.append(row)
    return rows


def recover(path: str) -> tuple[dict[str, bool], int]:
    """(key -> row succeeded, bytes of torn tail removed) for an existing output file.

    A last line that is cut short (no newline, or not JSON) is what a kill leaves behind:
    it is truncated away. A bad line anywhere else means the file is not ours.
    """
    if not os.path.exists(path):
        return {}, 0
    with open(path, "rb") as f:
        data = f.read()
    done: dict[str, bool] = {}
    pos, n = 0, 0  # pos: end of the complete, parsed lines so far
    while pos < len(data):
        n += 1
        nl = data.find(b"\n", pos)
        if nl < 0:  # no newline: the last write was cut short
            break
        raw = data[pos:nl]
        if raw.strip():
            row = _parse(raw)
            if row is None:
                if not data[nl + 1:].strip():  # the last line: torn
                    break
                raise ValueError(f"{path}:{n} is not a JSON object row; the output file "
                                 "was changed by something other than jetserve batch")
            done[output_key(row)] = "error" not in row
        pos = nl + 1
    good_end = pos
    torn = len(data) - good_end
    if torn:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return done, torn


def _parse(raw: bytes) -> dict | None:
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(row, dict) or ("id" not in row and "line" not in row):
        return None
    return row


class Journal:
    """An output file opened for appending durable rows."""

    def __init__(self, path: str, *, resume: bool, retry_failed: bool = False):
        if not resume and os.path.exists(path) and os.path.getsize(path) > 0:
            raise ValueError(f"--output {path} already exists; pass --resume to continue "
                             "that job, or remove the file to start over")
        self.path = path
        self.done, self.torn_bytes = recover(path) if resume else ({}, 0)
        self.dropped = 0  # error rows removed to run again
        if retry_failed and not all(self.done.values()):
            self.dropped = _drop_failed(path)
            self.done = {k: ok for k, ok in self.done.items() if ok}
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        created = not os.path.exists(path)
        self._f = open(path, "ab")  # noqa: SIM115 (closed by close())
        if created:  # the new directory entry must survive a crash too
            _fsync_dir(parent)

    def append(self, rows: Iterable[dict]) -> None:
        """Writes rows (complete lines) and waits until they are on disk."""
        data = b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in rows)
        if not data:
            return
        self._f.write(data)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_failed(path: str) -> int:
    """Rewrites the (recovered) output without its error rows; returns how many."""
    rows = read_rows(path)
    kept = [r for r in rows if "error" not in r]
    tmp = f"{path}.retrying"
    with open(tmp, "wb") as f:
        f.write(b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return len(rows) - len(kept)


def _fsync_dir(path: str) -> None:
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

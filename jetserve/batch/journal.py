"""The output file as a journal: rows appended and fsync'd, read back to resume.

A row is on disk before the job counts it done: `append` writes complete lines (each
ending in a newline) with `os.write` on an unbuffered descriptor and then `os.fsync`, so
after a SIGKILL or power loss the file holds every row appended so far, plus at most one
torn line at the end (a write cut short). Resuming (recovery.py) truncates that torn line
and verifies the rest before trusting it; `--retry-failed` and `--repair` rewrite the
file without its error rows or its bad lines (a new file renamed over the old: a crash
leaves one or the other).

A write that fails (a full disk, an I/O error) is undone: the file is cut back to the
rows before it, and `OutputError` names the path, so the job stops with the output
resumable once there is room.

A row's key is what identifies its input row: the id (canonical JSON, see rows.id_key)
for rows that have a usable id, and "#line N" for error rows about input lines without
one (not JSON, no id) or with a duplicate id; those carry `"line": N`.

Used by one thread (the batch runner's main thread); nothing here is shared.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable

from jetserve.batch.durable import OutputError, describe, fsync_dir, write_all
from jetserve.batch.recovery import Recovered, recover
from jetserve.batch.rows import line_key, output_key

__all__ = ["Journal", "OutputError", "line_key", "output_key", "part_path", "read_rows",
           "recover"]


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


def encode_row(row: dict) -> bytes:
    """One output line. Text stays readable (ensure_ascii off) unless it holds something
    UTF-8 cannot carry (a lone surrogate quoted in a message): then JSON escapes."""
    try:
        return (json.dumps(row, ensure_ascii=False) + "\n").encode()
    except UnicodeEncodeError:
        return (json.dumps(row) + "\n").encode()


class Journal:
    """An output file opened for appending durable rows.

    resume: continue the file (see recovery.recover for what is checked); expected: the
    keys of the input rows this job runs, to check it against; retry_failed / repair:
    drop its error rows / its bad lines instead of keeping / refusing them.
    """

    def __init__(self, path: str, *, resume: bool, retry_failed: bool = False,
                 repair: bool = False, expected: Collection[str] | None = None):
        if not resume and os.path.exists(path) and os.path.getsize(path) > 0:
            raise ValueError(f"--output {path} already exists; pass --resume to continue "
                             "that job, or remove the file to start over")
        self.path = path
        rec = (recover(path, expected, drop_failed=retry_failed, repair=repair) if resume
               else Recovered({}))
        self.done = rec.done
        self.torn_bytes = rec.torn_bytes
        self.dropped = rec.dropped_failed  # error rows removed to run again
        self.repaired = rec.repaired  # bad lines --repair removed
        parent = os.path.dirname(os.path.abspath(path))
        created = not os.path.exists(path)
        try:
            os.makedirs(parent, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                               0o644)
        except OSError as e:
            raise OutputError(f"cannot open {path} for writing: {describe(e)}") from None
        self._end = os.fstat(self._fd).st_size  # where the last complete append ends
        self._failed: OutputError | None = None
        if created:  # the new directory entry must survive a crash too
            fsync_dir(parent)

    def append(self, rows: Iterable[dict]) -> None:
        """Writes rows (complete lines) and waits until they are on disk."""
        if self._failed is not None:
            raise self._failed
        data = b"".join(encode_row(r) for r in rows)
        if not data:
            return
        try:
            write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError as e:
            self._failed = OutputError(
                f"cannot write {self.path}: {describe(e)}; the rows written before are "
                "kept: make room (or make it writable) and run again with --resume")
            self._undo()
            raise self._failed from None
        self._end += len(data)

    def _undo(self) -> None:
        """Cuts a part-written append off; if even that fails, it is the torn last line
        that --resume removes."""
        try:
            os.ftruncate(self._fd, self._end)
            os.fsync(self._fd)
        except OSError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

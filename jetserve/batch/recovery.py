"""Reading an existing output file back to resume it: the torn tail, then verification.

A kill during a write leaves at most one torn line, the last (see journal.py); it is
truncated away, as the job never counted that row done. Every other line must be a row
this job wrote, because `--resume` trusts it: a row counted done is never run again.
So each complete line is checked:

- it is a JSON object with "id" (or "line", for an error row about an input line);
- it holds a result: one of text / token_ids (generation), logprob (scoring), error;
- its key is a row of the input this process runs (`expected`);
- it is the first row for that key.

A file that fails any check is refused, naming the first bad line and the way out:
`--repair` rewrites it (atomically, see durable.replace_atomically) with the first valid
row of each key, so input rows left without a result run again. `--retry-failed` drops
error rows the same way. Nothing is changed in a refused file.

Used by one thread (the batch runner's, before the job starts).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection

from jetserve.batch.durable import OutputError, describe, fsync_dir, replace_atomically
from jetserve.batch.rows import output_key

# A row without any of these records no result: counting it done would lose its row.
PAYLOAD_FIELDS = ("text", "token_ids", "logprob", "error")


class CorruptOutput(ValueError):
    """The output file holds lines this job did not write (or wrote twice)."""


@dataclasses.dataclass
class Recovered:
    done: dict[str, bool]  # key -> the row succeeded (an error row: False)
    torn_bytes: int = 0  # torn last line removed
    dropped_failed: int = 0  # error rows removed to run again (--retry-failed)
    repaired: list[str] = dataclasses.field(default_factory=list)  # lines --repair dropped


def recover(path: str, expected: Collection[str] | None = None, *,
            drop_failed: bool = False, repair: bool = False) -> Recovered:
    """What an existing output file holds (nothing when there is none).

    expected: the keys of the input rows this process runs (None: not checked).
    drop_failed: remove error rows, so that they run again. repair: remove bad lines
    instead of refusing the file. Raises CorruptOutput when a line is bad and repair is
    off; OutputError when the file cannot be changed.
    """
    if not os.path.exists(path):
        return Recovered({})
    if not os.path.isfile(path):
        raise ValueError(f"--output {path} is not a regular file; --resume continues the "
                         "file an earlier run wrote")
    with open(path, "rb") as f:
        data = f.read()
    lines, good_end = _complete_lines(data)
    rec = Recovered({}, torn_bytes=len(data) - good_end)
    keep = _check(path, lines, expected, drop_failed, rec)
    if rec.repaired and not repair:
        raise CorruptOutput(_refusal(path, rec.repaired))
    try:
        if rec.repaired or rec.dropped_failed:
            replace_atomically(path, b"".join(data[a:b] for a, b in keep), suffix=".repairing")
        elif rec.torn_bytes:
            _truncate(path, good_end)
    except OSError as e:
        if isinstance(e, OutputError):
            raise
        raise OutputError(f"cannot remove the torn last line of {path}: {describe(e)}") \
            from None
    return rec


def _complete_lines(data: bytes) -> tuple[list[tuple[int, int, int, dict | None]], int]:
    """(line number, start, end past the newline, row or None when not a row) of each
    non-blank complete line, and where the last of them ends. A last line without its
    newline, or one that is not JSON, is a write cut short: left out."""
    lines = []
    pos, n = 0, 0
    while pos < len(data):
        n += 1
        nl = data.find(b"\n", pos)
        if nl < 0:
            break
        raw = data[pos:nl]
        if raw.strip():
            row = _parse(raw)
            if row is None and not data[nl + 1:].strip():  # the last line: torn
                break
            lines.append((n, pos, nl + 1, row))
        pos = nl + 1
    return lines, pos


def _parse(raw: bytes) -> dict | None:
    try:
        row = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError
        return None
    if not isinstance(row, dict) or ("id" not in row and "line" not in row):
        return None
    return row


def _check(path: str, lines, expected: Collection[str] | None, drop_failed: bool,
           rec: Recovered) -> list[tuple[int, int]]:
    """Fills rec (done, dropped_failed, repaired: the bad lines); returns the byte spans
    of the rows to keep, in file order."""
    first: dict[str, int] = {}
    keep = []
    for n, start, end, row in lines:
        where = f"{path}:{n}"
        if row is None:
            rec.repaired.append(f'{where} is not a JSON object row with an "id"')
            continue
        ok = "error" not in row
        if drop_failed and not ok:
            rec.dropped_failed += 1
            continue
        try:
            key = output_key(row)
        except (TypeError, ValueError):  # an id JSON cannot even write back
            rec.repaired.append(f"{where} has an id that is not a JSON value")
            continue
        if not any(f in row for f in PAYLOAD_FIELDS):
            rec.repaired.append(f"{where} has no result (none of the fields "
                                f"{', '.join(PAYLOAD_FIELDS)})")
        elif expected is not None and key not in expected:
            rec.repaired.append(f"{where} is for {_what(row)}, which is not a row of the "
                                "input this job runs")
        elif key in first:
            rec.repaired.append(f"{where} repeats {_what(row)} (first on line {first[key]})")
        else:
            first[key] = n
            rec.done[key] = ok
            keep.append((start, end))
    return keep


def _what(row: dict) -> str:
    if "line" in row:
        return f"the error row of input line {_short(row['line'])}"
    return f"id {_short(row['id'])}"


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _refusal(path: str, problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more bad lines)" if len(problems) > 1 else ""
    return (f"{problems[0]}{more}: --output does not hold this job's rows alone; run "
            "again with --resume --repair to rewrite it keeping the first valid row of "
            "each input row (input rows left without one run again)")


def _truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(os.path.abspath(path)))

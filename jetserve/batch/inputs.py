"""Reading the input file: which rows exist, who runs them, and which are left to do.

The input is read twice. The first pass (`scan`) only parses each line's JSON to find its
id: it decides ownership (`owner`: a stable hash of the id, so every process of an
independent run agrees without talking), finds duplicate ids and unreadable lines, and
keeps nothing but line numbers and keys, so a file of millions of rows costs little
memory. The second pass (`read_lines`) re-reads the lines still to run, a window at a
time, for the runner to tokenize and order.

Blank lines are skipped and numbered like any other line (line numbers are the file's).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator

from jetserve.batch.rows import RowError, id_key, line_key, parse_line, row_id


@dataclasses.dataclass(frozen=True)
class Entry:
    """One non-blank input line, as far as the first pass knows it."""

    line: int  # 1-based line number in the input file
    id: object | None  # the row's id, when it has a usable one
    key: str  # output key (rows.output_key of its result row)
    error: str | None  # set when the line cannot run at all (bad JSON, no id, duplicate)

    def error_row(self, message: str | None = None) -> dict:
        row = {"id": self.id, "error": message or self.error}
        if self.key.startswith("#line"):
            row["line"] = self.line
        return row


def owner(key: str, num_processes: int) -> int:
    """The process that runs the row with this key: the same answer on every host, every
    run (Python's hash() is salted per process, so a digest is used)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_processes


def scan(path: str) -> list[Entry]:
    """Every non-blank line of the input, in order (first pass)."""
    entries: list[Entry] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                rid = row_id(parse_line(text))
            except RowError as e:
                entries.append(Entry(n, None, line_key(n), f"line {n}: {e}"))
                continue
            key = id_key(rid)
            if key in first_line:
                entries.append(Entry(n, rid, line_key(n),
                                     f"line {n}: duplicate id {rid!r} (first on line "
                                     f"{first_line[key]}); ids must be unique"))
                continue
            first_line[key] = n
            entries.append(Entry(n, rid, key, None))
    return entries


def mine(entries: Iterable[Entry], process_id: int, num_processes: int) -> list[Entry]:
    """The entries this process owns (all of them when it is the only one)."""
    if num_processes == 1:
        return list(entries)
    return [e for e in entries if owner(e.key, num_processes) == process_id]


def read_lines(path: str, wanted: Iterable[int]) -> Iterator[tuple[int, str]]:
    """(line number, text) of the wanted lines, in file order (second pass)."""
    todo = sorted(set(wanted))
    if not todo:
        return
    i = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, text in enumerate(f, 1):
            if n == todo[i]:
                yield n, text
                i += 1
                if i == len(todo):
                    return

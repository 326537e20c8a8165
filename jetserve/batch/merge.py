"""`jetserve batch --merge`: the parts of an independent N-process run, in input order.

Each process of `--num-processes N --process-id I` (no coordinator) wrote
`OUT.part-I-of-N` with its rows in completion order. Merging reads the input once for
the order (the same first pass as a run: line numbers, ids, duplicates), reads every
part, and writes OUT with one row per input line, in input order. It refuses to write
an incomplete result: a missing part or row is named, with the process to resume.
The merged file is written to a temporary name, fsync'd and renamed, so OUT is either
absent or complete.
"""

from __future__ import annotations

import os

from jetserve.batch import inputs
from jetserve.batch.durable import replace_atomically
from jetserve.batch.journal import encode_row, output_key, part_path, read_rows
from jetserve.batch.preflight import check_paths


def merge(input_path: str, output: str, num_processes: int) -> tuple[int, int]:
    """Writes the merged output; returns (rows, error rows)."""
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    check_paths(input_path, output)
    entries = inputs.scan(input_path)
    rows: dict[str, dict] = {}
    for i in range(num_processes):
        path = part_path(output, i, num_processes)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: run process {i} of {num_processes} "
                                    "(add --resume if it was started)")
        for row in read_rows(path):
            rows[output_key(row)] = row
    missing = [e for e in entries if e.key not in rows]
    if missing:
        e = missing[0]
        who = inputs.owner(e.key, num_processes)
        raise ValueError(f"{len(missing)} input rows have no result yet (first: line "
                         f"{e.line}, id {e.id!r}, process {who}); run the unfinished "
                         "processes again with --resume, then merge")
    merged = [rows[e.key] for e in entries]
    replace_atomically(output, b"".join(encode_row(r) for r in merged), suffix=".merging")
    return len(entries), sum("error" in r for r in merged)

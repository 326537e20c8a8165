"""Checks that a parsed input row is data the rest of the pipeline can handle.

JSON lets a line carry things no later stage is ready for: a lone surrogate (`"\\ud800"`)
decodes to a Python str that no tokenizer and no UTF-8 writer accepts (sentencepiece
raises RuntimeError, `str.encode` UnicodeEncodeError), and deep nesting makes
`json.loads` / `json.dumps` recurse past Python's limit (RecursionError). Either would
otherwise surface far from the row that caused it and end the whole job, so a row is
checked once, right after parsing, and refused with the path of the offending field
(`messages[0].content`), which the runner turns into that row's error row.

The walk is iterative (a deep row must not recurse here either) and visits each value
once; strings are checked with one C-level encode, ASCII ones not at all.
"""

from __future__ import annotations

from typing import Any

from jetserve.server.validation import text_problem

# Real rows are a few levels deep (messages -> message -> content parts); metadata gets
# plenty of room. Low enough that json.dumps of the output row stays far from the
# recursion limit wherever it is called.
MAX_DEPTH = 64


class Malformed(ValueError):
    """A row that is not well-formed data; the message names the field."""


def check(obj: Any, root: str = "") -> None:
    """Raises Malformed when obj nests deeper than MAX_DEPTH or holds a string (a value
    or a key) with a lone surrogate."""
    stack: list[tuple[Any, str, int]] = [(obj, root, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            why = text_problem(value)
            if why:
                raise Malformed(f"{path or 'the row'} contains {why}")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_DEPTH:
                raise Malformed(f"{path or 'the row'} is nested more than {MAX_DEPTH} "
                                "levels deep; flatten it")
            if isinstance(value, dict):
                for k, item in value.items():
                    where = f"{path}.{k}" if path else str(k)
                    why = text_problem(k)
                    if why:
                        raise Malformed(f"a field name in {path or 'the row'} contains {why}")
                    stack.append((item, where, depth + 1))
            else:
                stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))

"""Reads one tool-call object `{"name": ..., "arguments": ...}` character by character.

Only JSON strings and nesting are tracked (the grammar, or the client's json.loads, judges
the rest), which is enough to say where the name and the arguments are, so the arguments
can be sent on as they are generated.
"""

from __future__ import annotations

import json

ARG_KEYS = ("arguments", "parameters")  # Llama 3.x's templates say "parameters"


class CallScanner:
    """Reads one call object `{"name": ..., "arguments": ...}` as its text arrives.

    Tracks JSON strings and nesting only (the grammar, or json.loads, judges the rest).
    `feed` returns the name once its string value is complete, and the raw text of the
    arguments value as it grows (held back until the name is known, whatever the key
    order). `done`: the object closed; `bad`: the text is not such an object.
    """

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = False
        self.key_chars: list[str] | None = None  # a top-level key being read
        self.key: str | None = None  # whose value comes next or is being read
        self.await_colon = False  # a key read, its ':' not yet
        self.name_chars: list[str] = []
        self.name: str | None = None
        self.args: list[str] = []  # argument text not yet handed out
        self.args_seen = False  # the arguments' key and its ':' are read
        self.done = self.bad = False

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the name if it completed in this text, argument text now known)."""
        had_name = self.name is not None
        for c in text:
            if self.done or self.bad:
                self.bad = self.bad or not c.isspace()
                continue
            self.step(c)
        if self.name is None:
            return None, ""
        return (None if had_name else self.name), self.take_args()

    def take_args(self) -> str:
        """The argument text read since the last call (all of it is kept until the name
        is known, so a caller can wait for it)."""
        frag, self.args = "".join(self.args), []
        return frag

    def step(self, c: str) -> None:
        """Reads one character (not after `done` or `bad`)."""
        if self.in_string:
            self._keep(c)
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.key_chars is not None:
                    self.key = json.loads("".join(self.key_chars))
                    self.key_chars, self.await_colon = None, True
            return
        if self.depth == 0:
            if c == "{":
                self.depth = 1
            elif not c.isspace():
                self.bad = True
            return
        if self.depth == 1 and self.key is None:  # between members
            if c == '"':
                self.key_chars, self.in_string = ['"'], True
            elif c == "}":
                self._close()
            elif not (c.isspace() or c == ","):
                self.bad = True
            return
        if self.await_colon:
            if c == ":":
                self.await_colon = False
                self.args_seen = self.args_seen or self.key in ARG_KEYS
            elif not c.isspace():
                self.bad = True
            return
        self._value(c)

    def _value(self, c: str) -> None:
        if self.depth == 1 and c in ",}":
            if self.key == "name":
                self._set_name()
            self.key = None
            if c == "}":
                self._close()
            return
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
        if not (self.depth == 1 and c.isspace()):
            self._keep(c)

    def _keep(self, c: str) -> None:
        if self.key_chars is not None:
            self.key_chars.append(c)
        elif self.key == "name":
            self.name_chars.append(c)
        elif self.key in ARG_KEYS:
            self.args.append(c)

    def _set_name(self) -> None:
        try:
            name = json.loads("".join(self.name_chars))
        except json.JSONDecodeError:
            name = None
        if isinstance(name, str):
            self.name = name
        else:
            self.bad = True

    def _close(self) -> None:
        self.depth = 0
        self.done = True
        self.bad = self.bad or self.name is None

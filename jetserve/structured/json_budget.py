"""json_object within max_tokens: a JSON object that always closes before the budget ends.

`response_format: json_object` allows any JSON object, and a model sampling at a high
temperature may write a string or a nesting that never ends: cut by max_tokens, the
answer is not JSON. `JsonBudget` follows the object's text and narrows the grammar's mask
only when the budget gets short, so the object can always still be closed:

  S  the shortest text that completes the object from here (`closing()`: a quote that
     ends an open string, a value a key still needs, then `]` / `}` for each open
     container), |S| its length in bytes;
  r  the tokens the request may still generate, this one included.

Every byte of S is a token of its own in any vocabulary llguidance serves (byte fallback
or byte-level BPE), so the object closes in r tokens while |S| <= r. A step keeps that
true by allowing only the tokens t with |S| + growth(t) <= r - 1, where growth(t) bounds
how much t can lengthen S (no byte adds more than 4: a `,` in an object needs `"":0`),
plus the tokens that spell a prefix of S (they shorten it). Far from the end nothing is
removed; in the last steps the object is steered shut. Inside a string, bytes before the
closing quote add nothing, so prose keeps flowing until a few steps before the end.

This is the json_object contract jetserve serves (README): with max_tokens >= 2 the
answer parses. Other kinds are left alone (a schema's shortest completion is the
schema's to say).
"""

from __future__ import annotations

import numpy as np

# Bytes that may lengthen S outside a string (a value, key, escape, number part or
# literal they start), at most by 4 each.
_GROWING = frozenset(b'{["\\:,-.eEtfnu')
_STEP_MAX = 4
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}
_NUMBER = frozenset(b"0123456789+-.eE")


class JsonCloser:
    """The shortest completion of a JSON object's text so far (fed bytes in order)."""

    def __init__(self):
        self.stack: list[str] = []  # "o" / "a": the open containers, outermost first
        self.state = "start"  # where the text is: see _step
        self.pending = b""  # bytes a literal, escape or number part still needs

    def feed(self, data: bytes) -> None:
        for c in data:
            self._step(c)

    @property
    def in_string(self) -> bool:
        return self.state in ("str", "key")

    def closing(self) -> bytes:
        """S: the shortest bytes that close the object from here."""
        tail = b"".join(b"}" if k == "o" else b"]" for k in reversed(self.stack))
        need = {"start": b"{}", "key_next": b'"":0', "key": b'":0', "colon": b":0",
                "value": b"0", "str": b'"'}.get(self.state, b"")
        if self.state == "key" and self.pending:  # an escape in a key
            need = self.pending + b'":0'
        elif self.state == "str" and self.pending:
            need = self.pending + b'"'
        elif self.state in ("lit", "num_need"):
            need = self.pending
        return need + tail

    def _step(self, c: int) -> None:
        s = self.state
        if s in ("str", "key"):
            return self._string(c)
        if s == "lit":
            self.pending = self.pending[1:]
            self.state = "lit" if self.pending else "after"
            return
        if s in ("num", "num_need"):
            if c in _NUMBER:
                self.state, self.pending = ("num_need", b"0") if c in b"-+.eE" else ("num", b"")
                return
            self.state, self.pending = "after", b""
            s = "after"
        if c == ord("{"):
            self.stack.append("o")
            self.state = "obj"
        elif c == ord("["):
            self.stack.append("a")
            self.state = "arr"
        elif c in (ord("}"), ord("]")):
            self.stack.pop()
            self.state = "after" if self.stack else "done"
        elif c == ord('"'):
            self.state = "key" if s in ("obj", "key_next") else "str"
        elif c == ord(":"):
            self.state = "value"
        elif c == ord(","):
            self.state = "key_next" if self.stack[-1] == "o" else "value"
        elif c in _LITERALS:
            self.state, self.pending = "lit", _LITERALS[c]
        elif c in _NUMBER:
            self.state, self.pending = ("num_need", b"0") if c == ord("-") else ("num", b"")

    def _string(self, c: int) -> None:
        p = self.pending
        if p:  # inside an escape: b"n" after a backslash, b"0000".. in a \u escape
            self.pending = b"0000" if p == b"n" and c == ord("u") else p[1:]
        elif c == ord("\\"):
            self.pending = b"n"
        elif c == ord('"'):
            self.state = "colon" if self.state == "key" else "after"


class GrowthTable:
    """Per token of one vocabulary: its bytes, and how much it may lengthen S from
    outside a string (`anywhere`) and from inside one (`in_string`: bytes before its
    first quote add nothing)."""

    def __init__(self, token_bytes: list[bytes]):
        self.bytes = token_bytes
        self.anywhere = np.array([_STEP_MAX * _growing(b) for b in token_bytes], np.int32)
        self.in_string = np.array([_in_string_growth(b) for b in token_bytes], np.int32)
        self.ids: dict[bytes, list[int]] = {}
        for i, b in enumerate(token_bytes):
            if b:
                self.ids.setdefault(b, []).append(i)
        self.longest = max(map(len, token_bytes), default=1)


def _growing(b: bytes) -> int:
    return sum(c in _GROWING for c in b)


def _in_string_growth(b: bytes) -> int:
    q = b.find(b'"')
    body, rest = (b, b"") if q < 0 else (b[:q], b[q:])
    return _STEP_MAX * (body.count(b"\\") + _growing(rest))


class JsonBudget:
    """One json_object request's closer and the mask narrowing it asks for."""

    def __init__(self, table: GrowthTable, vocab_size: int):
        self.table = table
        self.vocab_size = vocab_size
        self.closer = JsonCloser()
        self._worst = int(table.anywhere.max(initial=0))

    def take(self, token: int) -> None:
        if 0 <= token < len(self.table.bytes):
            self.closer.feed(self.table.bytes[token])

    def narrow(self, row: np.ndarray, remaining: int) -> None:
        """Narrows one packed mask row i32[W] (in place) so that the object can still
        close in `remaining` - 1 tokens after this one; left as it is when the budget is
        no concern yet, or when nothing would be left (a budget already too short)."""
        S = self.closer.closing()
        slack = remaining - 1 - len(S)
        if slack >= self._worst:
            return
        V = self.vocab_size
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:V].astype(bool)
        growth = self.table.in_string if self.closer.in_string and not self.closer.pending \
            else self.table.anywhere
        keep = np.zeros(V, bool)
        n = min(V, len(growth))
        keep[:n] = growth[:n] <= slack
        for k in range(1, min(len(S), self.table.longest) + 1):
            for i in self.table.ids.get(S[:k], ()):
                if i < V:
                    keep[i] = True
        narrowed = allowed & keep
        if not narrowed.any():
            return
        bits = np.zeros(row.size * 32, np.uint8)
        bits[:V] = narrowed
        row[:] = np.packbits(bits, bitorder="little").view(np.int32)

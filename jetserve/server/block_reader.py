"""Reads the calls of a block format (jetserve.server.call_blocks) out of one choice's
text as it streams, giving back content and OpenAI `tool_calls` delta entries, as
jetserve.server.tool_output.CallReader does for the JSON formats.

Text outside blocks is content (a possible start of the open marker is held back). A
block's calls go out as its parser reads them: a call's first entry (index, id, type,
name) once its name is read and is one of the tools, then its arguments as they grow.
A block whose text is no call of a listed tool is content, verbatim; whitespace next to
a call is dropped. `max_calls` 1 (parallel_tool_calls false): nothing after the first
call is read.
"""

from __future__ import annotations

from typing import Any

from jetserve.server.call_blocks import BlockFormat, NotCall, Partial, new_call_id
from jetserve.server.held_text import CallContent, partial


class BlockReader(CallContent):
    """The calls of one choice written in `fmt` (see the module docstring)."""

    def __init__(self, fmt: BlockFormat, tools: list[dict], max_calls: int | None = None):
        self.fmt, self.max_calls = fmt, max_calls
        self.schemas = {t["function"]["name"]: t["function"].get("parameters") or {}
                        for t in tools}
        self.state = "start" if fmt.at_start else "content"
        self.buf = ""
        self.raw = ""  # the open block's text, marker included: content if no call comes
        self.sent: list[tuple[int, int]] = []  # per call of the block: (index, args sent)
        self.count = 0
        self.ws, self.after_call = "", False
        self.out: list[str] = []
        self.calls: list[dict] = []

    def _type(self, name: str, key: str) -> Any:
        props = (self.schemas.get(name) or {}).get("properties") or {}
        return (props.get(key) or {}).get("type")

    def _run(self, final: bool) -> tuple[str, list[dict]]:
        self.out, self.calls = [], []
        while True:
            if self.state == "done":
                self.buf = ""
                break
            if self.state == "start":
                s, m = self.buf.lstrip(), self.fmt.open
                if not final and m.startswith(s):
                    break
                if s.startswith(m):
                    self._text(self.buf[:len(self.buf) - len(s)])
                    self._open(len(self.buf) - len(s))
                else:
                    self.state = "content"
                continue
            if self.state == "content":
                if self.fmt.at_start:  # no block after the start
                    self._text(self.buf)
                    self.buf = ""
                    break
                k = self.buf.find(self.fmt.open)
                if k < 0:
                    keep = 0 if final else partial(self.buf, self.fmt.open)
                    self._text(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._text(self.buf[:k])
                self._open(k)
                continue
            if not self._block(final):  # state "block"
                break
        return "".join(self.out), self.calls

    def _open(self, at: int) -> None:
        n = at + len(self.fmt.open)
        self.raw, self.buf = self.buf[at:n], self.buf[n:]
        self.state, self.sent = "block", []

    def _block(self, final: bool) -> bool:
        """Reads the open block; True when it ended (the reader moves on)."""
        close = self.fmt.close
        k = self.buf.find(close) if close else -1
        ended = final or k >= 0
        body = self.buf[:k] if k >= 0 else self.buf
        if not ended and close:
            body = body[:len(body) - partial(body, close)]
        try:
            calls = self.fmt.read(body, ended, self._type)
            if any(name not in self.schemas for name, _, _ in calls):
                raise NotCall
        except NotCall:
            if not self.sent:
                return self._fail(k, close)
            calls = []
        self._send(calls)
        if not ended:
            return False
        if not self.sent:  # an empty block, or only a cut-off call: not a call
            return self._fail(k, close)
        self.buf = self.buf[k + len(close):] if k >= 0 else ""
        self.raw, self.after_call = "", True
        full = self.max_calls and self.count >= self.max_calls
        self.state = "done" if full else "content"
        return True

    def _send(self, calls: list[Partial]) -> None:
        for j, (name, args, _done) in enumerate(calls):
            if j == len(self.sent):
                if self.max_calls and self.count >= self.max_calls:
                    return
                self.ws = ""
                self.calls.append({"index": self.count, "id": new_call_id(),
                                   "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                self.sent.append((self.count, 0))
                self.count += 1
            index, at = self.sent[j]
            if len(args) > at:
                frag = args[at:]
                last = self.calls[-1] if self.calls else None
                if last is not None and last["index"] == index:
                    last["function"]["arguments"] += frag
                else:
                    self.calls.append({"index": index, "function": {"arguments": frag}})
                self.sent[j] = (index, len(args))

    def _fail(self, k: int, close: str) -> bool:
        """The block is no call: its text is content, read on after it."""
        end = k + len(close) if k >= 0 else len(self.buf)
        self._text(self.raw + self.buf[:end])
        self.buf, self.raw = self.buf[end:], ""
        self.state = "content"
        return True

"""Text held back while a stream is read: the start of a marker not yet complete, and
whitespace next to a tool call (shared by the call readers and the thinking splitter)."""

from __future__ import annotations


def partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class CallContent:
    """The half every call reader shares: text fed in, (content, call deltas) out, and
    the content it gives out: whitespace next to a call is dropped, and trailing
    whitespace is held back until more text says whether a call follows.

    A reader keeps `buf` (text not yet read), `count` (calls that went out), `out` (this
    read's content pieces), `ws` (held whitespace, dropped when a call goes out) and
    `after_call` (the last thing read was a call), and reads in `_run`."""

    buf: str
    count: int
    out: list[str]
    ws: str
    after_call: bool

    @property
    def called(self) -> bool:
        return self.count > 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self._run(final=True)
        if not self.called:
            content, self.ws = content + self.ws, ""
        return content, calls

    def _run(self, final: bool) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def _text(self, s: str) -> None:
        """Content, without whitespace next to a call (held back until more comes)."""
        if self.after_call:
            s = s.lstrip()
            if not s:
                return
            self.after_call = False
        body = s.rstrip()
        if not body:
            self.ws += s
            return
        self.out.append(self.ws + body)
        self.ws = s[len(body):]

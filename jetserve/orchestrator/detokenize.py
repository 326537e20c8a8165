"""Incremental, UTF-8 safe detokenization and stop strings (plain Python, no threads).

`IncrementalDetokenizer` turns a stream of token ids into a stream of text using only the
tokenizer's own `decode`, so it works the same for sentencepiece (byte-fallback pieces,
leading-space markers), byte-level BPE `tokenizer.json` and the byte tokenizer. It decodes a
short sliding window of ids twice: the window up to the last emitted token, and the window
with the new tokens; the new text is the difference. Text is held back while it ends in
U+FFFD (a character whose bytes are split across tokens), so concatenating everything
emitted, plus `flush()` at the end, equals decoding all the tokens at once.

A tokenizer whose tokens are bytes (`id_to_bytes`, the byte tokenizer of random models)
takes a shortcut with the same result: Python's incremental UTF-8 decoder.

Decoding is seeded with the tail of the prompt, so a sentencepiece piece's leading space
is kept ("is" + "▁Paris" streams " Paris"): prompt text + streamed text == decode(prompt +
generated tokens).

`StopStrings` holds back text that could be the beginning of a stop string and cuts the
text before the first stop string found; the stop string itself is never emitted.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 6  # prompt tokens decoded with the output: enough for a leading space
_TRIM_AT = 64  # drop ids before the window once this many have piled up


class IncrementalDetokenizer:
    """Token ids in, safe text out. `decode(ids) -> str` is the tokenizer's decode."""

    def __init__(self, tokenizer, context_ids: Sequence[int] = ()):
        self._decode = tokenizer.decode
        ctx = [int(i) for i in list(context_ids)[-CONTEXT_TOKENS:]]
        ctx_text = self._decode(ctx) if ctx else ""
        if ctx_text.endswith(REPLACEMENT):
            # The prompt ends inside a character; its completion would rewrite prompt text.
            ctx, ctx_text = [], ""
        self._ids = ctx
        self._prefix = 0  # window start
        self._read = len(ctx)  # end of what has been emitted
        self._prefix_text = ctx_text  # decode(ids[prefix:read])

    def push(self, token: int) -> str:
        """Adds one token; returns the text that became safe (often "" mid-character)."""
        self._ids.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        """Everything still held back (the stream is over: a split character stays U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(self._prefix_text) or (not final and text.endswith(REPLACEMENT)):
            return ""
        out = text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        if self._prefix >= _TRIM_AT:
            del self._ids[: self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return out


class ByteDetokenizer:
    """For tokenizers whose token i is a byte string: incremental UTF-8 with replacement,
    which holds back a split character exactly as decoding everything at once would."""

    def __init__(self, tokenizer):
        self._bytes = tokenizer.id_to_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._utf8.decode(self._bytes(int(token)))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def make_detokenizer(tokenizer, context_ids: Sequence[int] = ()):
    """The detokenizer for this tokenizer (context is irrelevant for byte tokens)."""
    if hasattr(tokenizer, "id_to_bytes"):
        return ByteDetokenizer(tokenizer)
    return IncrementalDetokenizer(tokenizer, context_ids)


class StopStrings:
    """Holds back possible stop-string prefixes; finds the first stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string hit or None). After a hit, the
        text before it is returned and everything after is dropped."""
        if not self.stops:
            return text, None
        buf = self._held + text
        hit: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            self._held = ""
            return buf[: hit[0]], hit[1]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best


class TextStream:
    """Detokenizer plus stop strings for one request: what the stream emits as text."""

    def __init__(self, tokenizer, context_ids: Sequence[int], stop_strings: Sequence[str]):
        self._detok = make_detokenizer(tokenizer, context_ids) if tokenizer else None
        self._stops = StopStrings(stop_strings)

    def push(self, token: int) -> tuple[str, str | None]:
        """Text that became safe after `token`, and the stop string it completed, if any."""
        if self._detok is None:
            return "", None
        return self._stops.feed(self._detok.push(token))

    def finish(self) -> str:
        """The held-back text, when the request ends for a reason other than a stop string.

        A stop string can still complete inside the flushed text; it is cut there too.
        """
        if self._detok is None:
            return ""
        text, hit = self._stops.feed(self._detok.flush())
        return text if hit is not None else text + self._stops.flush()


def completion_text(tokenizer, prompt_ids: Sequence[int], token_ids: Sequence[int],
                    ended_by_stop_token: bool) -> str:
    """The text the orchestrator streams for `token_ids`, computed in one go (for loops
    that do not stream, such as jetserve.offline)."""
    ts = TextStream(tokenizer, prompt_ids, ())
    ids = token_ids[:-1] if ended_by_stop_token else token_ids
    return "".join(ts.push(t)[0] for t in ids) + ts.finish()

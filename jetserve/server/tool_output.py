"""Tool calls out of a chat choice's generated text, as OpenAI returns them.

One reader per choice (`ChoiceReader`) takes the text as it streams and gives back what
to send: content and `tool_calls` delta entries (the first for a call with its index, id,
type and name; then argument fragments with the index only). A non-streaming message is
the same reader fed the whole text (`message`), so both ways agree.

- A forced call (tool_choice "required" or named; jetserve.server.tool_calls): the whole
  output is one `{"name": ..., "arguments": ...}` object. The name goes out once its
  string is complete, then the arguments' text as it grows. Output that is not such an
  object (a cut-off or unconstrained one) is sent as content.
- tool_choice "auto": calls are `<tool_call>{...}</tool_call>` blocks in the text. Text
  outside them streams as content (a possible start of a tag is held back); a block goes
  out as one call once it is closed, or at the end, and only if it is a JSON object naming
  one of the tools (else it stays content). Whitespace next to a call is dropped, so a
  message that only calls has content null.

finish_reason "stop" becomes "tool_calls" when the choice made a call.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from jetserve.server.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolPlan


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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
        self.done = self.bad = False

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the name if it completed in this text, argument text now known)."""
        had_name = self.name is not None
        for c in text:
            if self.done or self.bad:
                self.bad = self.bad or not c.isspace()
                continue
            self._step(c)
        if self.name is None:
            return None, ""
        frag, self.args = "".join(self.args), []
        return (None if had_name else self.name), frag

    def _step(self, c: str) -> None:
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
        elif self.key in ("arguments", "parameters"):  # Llama 3.1's templates say "parameters"
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


class ForcedCall:
    """tool_choice "required" or named: the output is one call object."""

    def __init__(self) -> None:
        self.scanner = CallScanner()
        self.held = ""  # text read before the name, sent as content if it is no call
        self.called = self.plain = False
        self.has_args = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plain:
            return text, []
        name, frag = self.scanner.feed(text)
        if not self.called and self.scanner.bad:  # no call after all: it is content
            self.plain = True
            out, self.held = self.held + text, ""
            return out, []
        self.has_args = self.has_args or bool(frag)
        if name is None:
            if self.called:
                return "", [{"index": 0, "function": {"arguments": frag}}] if frag else []
            self.held += text
            return "", []
        self.called, self.held = True, ""
        return "", [{"index": 0, "id": new_call_id(), "type": "function",
                     "function": {"name": name, "arguments": frag}}]

    def finish(self) -> tuple[str, list[dict]]:
        if self.called:  # a call that closed without arguments takes none
            none = self.scanner.done and not self.has_args
            return "", [{"index": 0, "function": {"arguments": "{}"}}] if none else []
        out, self.held = self.held, ""
        return out, []


class TaggedCalls:
    """tool_choice "auto": `<tool_call>{...}</tool_call>` blocks in free text."""

    def __init__(self, names: list[str]) -> None:
        self.names = set(names)
        self.buf = ""
        self.in_call = False
        self.ws = ""  # trailing whitespace of the content so far, not yet sent
        self.after_call = False  # drop whitespace that follows a call
        self.count = 0

    @property
    def called(self) -> bool:
        return self.count > 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, list[dict]]:
        content, calls = self._drain(final=True)
        if not self.called:
            content, self.ws = content + self.ws, ""
        return content, calls

    def _drain(self, final: bool) -> tuple[str, list[dict]]:
        content: list[str] = []
        calls: list[dict] = []
        while True:
            if not self.in_call:
                k = self.buf.find(TOOL_CALL_OPEN)
                if k < 0:
                    keep = 0 if final else _tag_start(self.buf)
                    content.append(self._content(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self._content(self.buf[:k]))
                self.buf, self.in_call = self.buf[k + len(TOOL_CALL_OPEN):], True
                continue
            k = self.buf.find(TOOL_CALL_CLOSE)
            if k < 0 and not final:
                break
            body, rest = (self.buf, "") if k < 0 else (
                self.buf[:k], self.buf[k + len(TOOL_CALL_CLOSE):])
            call = self._call(body)
            if call is None:
                content.append(self._content(
                    TOOL_CALL_OPEN + body + ("" if k < 0 else TOOL_CALL_CLOSE)))
            else:
                calls.append(call)
                self.ws, self.after_call = "", True
            self.buf, self.in_call = rest, False
            if k < 0:
                break
        return "".join(content), calls

    def _content(self, s: str) -> str:
        if self.after_call:
            s = s.lstrip()
            if not s:
                return ""
            self.after_call = False
        body = s.rstrip()
        if not body:
            self.ws += s
            return ""
        out, self.ws = self.ws + body, s[len(body):]
        return out

    def _call(self, body: str) -> dict | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        entry = {"index": self.count, "id": new_call_id(), "type": "function",
                 "function": {"name": obj["name"], "arguments": args}}
        self.count += 1
        return entry


def _tag_start(text: str) -> int:
    """How many characters at the end of `text` could begin a tool-call tag."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ChoiceReader:
    """One chat choice's text -> OpenAI deltas; plain content when no tool is in play."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.parser: ForcedCall | TaggedCalls | None = None
        if plan is not None:
            self.parser = ForcedCall() if plan.forced else TaggedCalls(
                [t["function"]["name"] for t in plan.tools])

    def opening(self) -> dict:
        """The first delta. Content null where it may stay so (OpenAI's way when tools
        are in play): the openai SDK then assembles a message that only calls with
        content None, as a non-streaming one has."""
        return {"role": "assistant", "content": "" if self.parser is None else None}

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the delta for this text, the choice's finish_reason as OpenAI names it)."""
        if self.parser is None:
            return ({"content": text} if text or finish_reason is None else {}), finish_reason
        content, calls = self.parser.feed(text)
        if finish_reason is not None:
            more, more_calls = self.parser.finish()
            content, calls = content + more, calls + more_calls
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if finish_reason == "stop" and self.parser.called:
            finish_reason = "tool_calls"
        return delta, finish_reason


def message(plan: ToolPlan | None, text: str,
            finish_reason: str | None) -> tuple[dict, str | None]:
    """The whole assistant message of a choice, and its finish_reason."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    delta, finish_reason = ChoiceReader(plan).delta(text, finish_reason or "stop")
    calls: list[dict] = []
    for entry in delta.get("tool_calls", ()):
        if entry["index"] == len(calls):
            calls.append({"id": entry["id"], "type": "function",
                          "function": dict(entry["function"])})
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    out: dict[str, Any] = {"role": "assistant",
                           "content": delta.get("content") or (None if calls else "")}
    if calls:
        out["tool_calls"] = calls
    return out, finish_reason

"""Tool calls out of a chat choice's generated text, as OpenAI returns them.

One reader per choice (`ChoiceReader`) takes the text as it streams and gives back what
to send: content and `tool_calls` delta entries (the first for a call with its index, id,
type and name; then argument fragments with the index only, as they are generated). A
non-streaming message is the same reader fed the whole text (`message`), so both ways
agree.

Where the calls are (jetserve.server.tool_formats):
- tool_choice "required" or named (jetserve.server.tool_calls): the whole output is one
  `{"name": ..., "arguments": ...}` object, or with parallel tool calls (required only) a
  JSON list of them. Output that is not (a cut-off or unconstrained one) is content.
- tool_choice "auto": the calls are in the format `--tool-call-parser` names. Text
  outside them streams as content (a possible start of a marker is held back); a block
  that is not a JSON object naming one of the tools stays content. Whitespace next to a
  call is dropped, so a message that only calls has content null. With
  parallel_tool_calls false, reading stops after the first call.

Formats that are not JSON objects (qwen3_coder, glm45, deepseek_v3, pythonic) are read
by jetserve.server.block_reader. With a reasoning parser the thinking is split off first
(jetserve.server.reasoning) and goes out as `reasoning_content`; only the answer is read
for calls.

finish_reason "stop" becomes "tool_calls" when the choice made a call.
"""

from __future__ import annotations

import json
from typing import Any

from jetserve.server.block_reader import BlockReader
from jetserve.server.call_blocks import BLOCKS, new_call_id
from jetserve.server.call_scanner import CallScanner
from jetserve.server.held_text import CallContent, partial
from jetserve.server.reasoning import ThinkFormat, ThinkSplitter
from jetserve.server.tool_calls import ToolPlan
from jetserve.server.tool_formats import FORCED_LIST, FORCED_ONE, PARSERS, CallFormat

__all__ = ["CallReader", "CallScanner", "ChoiceReader", "message", "new_call_id"]


class CallReader(CallContent):
    """The calls in one choice's text, written in `fmt`, as content and call deltas.

    A call's first entry goes out once its name is known to be one of `names` and its
    arguments begin (or it closes), so text that only looks like a call at first stays
    content; from then on its arguments go out as they arrive. A block that turns out not
    to be a call (bad JSON, an unknown name) is content, verbatim. `max_calls` 1 (parallel
    tool calls off): whatever follows the first call is dropped. `forced`: the output was
    constrained to calls, so a call goes out with its name.
    """

    def __init__(self, fmt: CallFormat, names: list[str], max_calls: int | None = None,
                 forced: bool = False):
        self.fmt, self.names, self.max_calls, self.forced = fmt, set(names), max_calls, forced
        self.state = "start" if fmt.at_start else "content"
        self.buf = ""  # text received and not yet read
        self.raw = ""  # the block's text since its last call: content if no call comes
        self.scanner: CallScanner | None = None
        self.emitted = False  # the current call's first entry went out
        self.args, self.sent = "", 0  # the current call's argument text; how much went out
        self.count = 0
        self.ws = ""  # trailing whitespace of the content so far, not yet sent
        self.after_call = False  # drop whitespace that follows a call
        self.out: list[str] = []
        self.calls: list[dict] = []

    def _run(self, final: bool) -> tuple[str, list[dict]]:
        self.out, self.calls = [], []
        steps = {"start": self._start, "content": self._content, "open": self._open,
                 "call": self._call, "after": self._after, "done": self._done}
        while steps[self.state](final):  # each says whether it moved on
            pass
        return "".join(self.out), self.calls

    def _start(self, final: bool) -> bool:
        """The output's start: a block may open here without its marker."""
        s, m = self.buf.lstrip(), self.fmt.marker
        lead = len(self.buf) - len(s)
        if s and m and s.startswith(m):
            self._text(self.buf[:lead])  # content if no call comes, dropped if one does
            return self._open_block(lead, lead + len(m))
        if not final and (not s or (m and m.startswith(s))):
            return False  # could still be the marker
        if s.startswith(self.fmt.opener or "{"):
            return self._open_block(0, lead)
        self.state = "content"
        return True

    def _content(self, final: bool) -> bool:
        m = self.fmt.marker
        k = self.buf.find(m) if m else -1
        if k < 0:
            keep = 0 if final or not m else partial(self.buf, m)
            self._text(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._text(self.buf[:k])
        return self._open_block(k, k + len(m))

    def _open_block(self, start: int, end: int) -> bool:
        self.raw, self.buf = self.buf[start:end], self.buf[end:]
        if self.fmt.opener:
            self.state = "open"
        else:
            self._new_call()
        return True

    def _open(self, final: bool) -> bool:
        s = self.buf.lstrip()
        if not s:
            return self._fail() if final else False
        if not s.startswith(self.fmt.opener):
            return self._fail()
        n = len(self.buf) - len(s) + len(self.fmt.opener)
        self.raw, self.buf = self.raw + self.buf[:n], self.buf[n:]
        self._new_call()
        return True

    def _new_call(self) -> None:
        self.state, self.scanner = "call", CallScanner()
        self.emitted, self.args, self.sent = False, "", 0

    def _call(self, final: bool) -> bool:
        sc = self.scanner
        assert sc is not None
        n = 0
        while n < len(self.buf) and not (sc.done or sc.bad):
            sc.step(self.buf[n])
            n += 1
        self.raw, self.buf = self.raw + self.buf[:n], self.buf[n:]
        ended = sc.done or sc.bad or final
        self._send(sc, ended)
        if not ended:
            return False
        if not self.emitted:  # not a call to a listed tool after all
            return self._fail()
        self.scanner, self.raw, self.after_call = None, "", True
        self.state = "done" if self.max_calls and self.count >= self.max_calls else "after"
        return True

    def _send(self, sc: CallScanner, ended: bool) -> None:
        """The call's first entry once it is sure to be a call, then its arguments."""
        self.args += sc.take_args()
        if not self.emitted:
            if sc.bad or sc.name not in self.names or not (
                    self.forced or sc.args_seen or sc.done):
                return
            self.emitted, self.ws = True, ""
            self.calls.append({"index": self.count, "id": new_call_id(), "type": "function",
                               "function": {"name": sc.name, "arguments": ""}})
            self.count += 1
        frag = self.args[self.sent:]
        if self.args.startswith('"'):  # arguments given as a JSON string: sent decoded
            if not ended:
                return
            frag = _string_value(self.args)
        elif sc.done and not self.args:  # a call without arguments takes none
            frag = "{}"
        self.sent = len(self.args)
        if not frag:
            return
        last = self.calls[-1] if self.calls else None
        if last is not None and last["index"] == self.count - 1:
            last["function"]["arguments"] += frag
        else:
            self.calls.append({"index": self.count - 1, "function": {"arguments": frag}})

    def _after(self, final: bool) -> bool:
        """After a call: the next one of the block, its close, or content."""
        s = self.buf.lstrip()
        sep, close = self.fmt.sep, self.fmt.close
        if not s and not final:
            return False
        for tok, nxt in ((sep, "call"), (close, "content")):
            if tok and s.startswith(tok):
                n = len(self.buf) - len(s) + len(tok)
                self.raw, self.buf = self.buf[:n], self.buf[n:]
                if nxt == "call":
                    self._new_call()
                else:
                    self.state, self.raw = "content", ""
                return True
        if s and any(tok and tok.startswith(s) for tok in (sep, close)):
            if not final:
                return False
            s = ""  # a cut-off close or separator says nothing
        self.state, self.buf = "content", s  # the block ended without its close
        return True

    def _done(self, final: bool) -> bool:
        self.buf = ""
        return False

    def _fail(self) -> bool:
        """The block is no call: its text is content, read on after it."""
        self._text(self.raw)
        self.raw, self.scanner, self.state = "", None, "content"
        return True


def _string_value(text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, str) else text


def reading_format(plan: ToolPlan) -> CallFormat:
    """Where a plan's calls are in the text: a forced call's fixed shape, or the parser's."""
    if not plan.forced:
        return PARSERS[plan.parser]
    return FORCED_LIST if plan.mode == "required" and plan.parallel else FORCED_ONE


def _reader(plan: ToolPlan) -> CallReader | BlockReader:
    names = [t["function"]["name"] for t in plan.tools]
    max_calls = None if plan.parallel else 1
    if not plan.forced and plan.parser in BLOCKS:
        return BlockReader(BLOCKS[plan.parser], list(plan.tools), max_calls)
    return CallReader(reading_format(plan), names, max_calls=max_calls, forced=plan.forced)


class ChoiceReader:
    """One chat choice's text -> OpenAI deltas; plain content when no tool is in play.

    `think`: the reasoning format (--reasoning-parser), when the model thinks: its
    thinking goes out as `reasoning_content`, and only the answer is read for calls."""

    def __init__(self, plan: ToolPlan | None, think: ThinkFormat | None = None) -> None:
        self.parser = None if plan is None else _reader(plan)
        self.split = None if think is None else ThinkSplitter(think)

    def opening(self) -> dict:
        """The first delta. Content null where it may stay so (OpenAI's way when tools
        are in play): the openai SDK then assembles a message that only calls with
        content None, as a non-streaming one has."""
        return {"role": "assistant", "content": "" if self.parser is None else None}

    def read(self, text: str, token_ids: Any, finish_reason: str | None
             ) -> tuple[dict, str | None]:
        """A stream's next piece (harmony.HarmonyReader reads the token ids instead)."""
        return self.delta(text, finish_reason)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the delta for this text, the choice's finish_reason as OpenAI names it)."""
        reasoning = ""
        if self.split is not None:
            reasoning, text = self.split.feed(text)
            if finish_reason is not None:
                more_r, more_t = self.split.finish()
                reasoning, text = reasoning + more_r, text + more_t
        delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if self.parser is None:
            if text or (finish_reason is None and self.split is None):
                delta["content"] = text
            return delta, finish_reason
        content, calls = self.parser.feed(text)
        if finish_reason is not None:
            more, more_calls = self.parser.finish()
            content, calls = content + more, calls + more_calls
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if finish_reason == "stop" and self.parser.called:
            finish_reason = "tool_calls"
        return delta, finish_reason


def message(plan: ToolPlan | None, text: str, finish_reason: str | None,
            think: ThinkFormat | None = None) -> tuple[dict, str | None]:
    """The whole assistant message of a choice, and its finish_reason (`think`: as
    ChoiceReader; the message then has `reasoning_content`, null when none)."""
    if plan is None and think is None:
        return {"role": "assistant", "content": text}, finish_reason
    delta, finish_reason = ChoiceReader(plan, think).delta(text, finish_reason or "stop")
    return assemble(delta, think is not None), finish_reason


def assemble(delta: dict, with_reasoning: bool) -> dict:
    """One delta holding a whole answer as the assistant message (`with_reasoning`: it has
    `reasoning_content`, null when there is none)."""
    calls: list[dict] = []
    for entry in delta.get("tool_calls", ()):
        if entry["index"] == len(calls):
            calls.append({"id": entry["id"], "type": "function",
                          "function": dict(entry["function"])})
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    out: dict[str, Any] = {"role": "assistant",
                           "content": delta.get("content") or (
                               None if calls or delta.get("reasoning_content") else "")}
    if with_reasoning:
        out["reasoning_content"] = delta.get("reasoning_content") or None
    if calls:
        out["tool_calls"] = calls
    return out

"""gpt-oss's harmony format, rendered and parsed by OpenAI's own `openai-harmony`.

On a server whose `--tool-call-parser` is `openai` or whose `--reasoning-parser` is
`openai_gptoss` (vLLM's names), a chat prompt is the harmony conversation
openai-harmony renders (not the jinja template): a system message with the reasoning
effort (`chat_template_kwargs.reasoning_effort`, or the Responses API's
`reasoning.effort`; default medium), a developer message with the request's
system/developer text as instructions and its function tools, then the turns (an
assistant's calls on the commentary channel to `functions.NAME`, a tool's answer from
`functions.NAME`). The answer's token ids go through openai-harmony's StreamableParser:
the analysis channel is `reasoning_content`, the final channel (and commentary without a
recipient) `content`, and a commentary message to `functions.NAME` a tool call whose
arguments stream as they are written.

The encoding needs the `o200k_base.tiktoken` vocabulary file, which openai-harmony
downloads on first use unless `TIKTOKEN_ENCODINGS_BASE` names a directory holding it;
with no network, that variable must be set (load_encoding says so when it fails).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from jetserve.server.call_blocks import new_call_id
from jetserve.server.validation import InvalidArgument, show

EFFORTS = ("low", "medium", "high")
_FUNCTIONS = "functions."


@functools.cache
def load_encoding() -> Any:
    """openai-harmony's gpt-oss encoding (loaded once); RuntimeError saying how to give
    it its vocabulary file when it cannot load."""
    import openai_harmony as oh

    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise RuntimeError(
            f"openai-harmony could not load gpt-oss's encoding ({e}): it needs "
            "o200k_base.tiktoken; set TIKTOKEN_ENCODINGS_BASE to a directory holding "
            "that file (it downloads it otherwise)") from None


def _effort(kwargs: dict[str, Any]) -> Any:
    import openai_harmony as oh

    effort = kwargs.get("reasoning_effort", "medium")
    if effort == "minimal":
        effort = "low"
    if effort not in EFFORTS:
        raise InvalidArgument("chat_template_kwargs", "reasoning_effort must be one of "
                                                      f"{', '.join(EFFORTS)}, got {show(effort)}")
    return oh.ReasoningEffort(effort.capitalize())


def _tool_names(messages: list[dict]) -> dict[str, str]:
    """Call id -> function name, from the assistants' calls."""
    return {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())
            if isinstance(c.get("id"), str)}


def prompt_ids(messages: list[dict], tools: list[dict] | None,
               kwargs: dict[str, Any]) -> list[int]:
    """A checked conversation (chat_template.normalize_messages) and tools as harmony
    prompt token ids, ending where the assistant's answer starts."""
    import openai_harmony as oh

    enc = load_encoding()
    system = oh.SystemContent.new().with_reasoning_effort(_effort(kwargs))
    out = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    instructions = "\n\n".join(m["content"] for m in messages
                               if m["role"] in ("system", "developer") and m["content"])
    dev = oh.DeveloperContent.new()
    if instructions:
        dev = dev.with_instructions(instructions)
    if tools:
        dev = dev.with_function_tools([
            oh.ToolDescription.new(t["function"]["name"], t["function"].get("description", ""),
                                   parameters=t["function"].get("parameters"))
            for t in tools])
    if instructions or tools:
        out.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
    names = _tool_names(messages)
    for m in messages:
        if m["role"] == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, m["content"]))
        elif m["role"] == "assistant":
            if m["content"]:
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m["content"])
                           .with_channel("final"))
            for c in m.get("tool_calls", ()):
                args = c["function"]["arguments"]
                args = args if isinstance(args, str) else json.dumps(args)
                out.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, args)
                           .with_channel("commentary")
                           .with_recipient(_FUNCTIONS + c["function"]["name"])
                           .with_content_type("<|constrain|>json"))
        elif m["role"] == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id", ""), "tool")
            author = oh.Author.new(oh.Role.TOOL, _FUNCTIONS + name)
            out.append(oh.Message.from_author_and_content(author, m["content"])
                       .with_channel("commentary"))
    conv = oh.Conversation.from_messages(out)
    return list(enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT))


class HarmonyReader:
    """One choice's answer tokens -> chat deltas (reasoning_content, content, tool_calls),
    as tool_output.ChoiceReader gives them for text.

    `names`: the tools (None: no tools in play, so a call is content); `max_calls` 1
    (parallel_tool_calls false): calls after the first are dropped."""

    def __init__(self, names: list[str] | None, max_calls: int | None = None):
        import openai_harmony as oh

        self.parser = oh.StreamableParser(load_encoding(), oh.Role.ASSISTANT)
        self.names, self.max_calls = names, max_calls
        self.count = 0
        self.in_call = False  # the current message is a call that went out
        self.broken = False  # the tokens stopped being harmony: the rest is dropped
        self.seen = 0  # messages the parser completed, read so far

    @property
    def called(self) -> bool:
        return self.count > 0

    def opening(self) -> dict:
        return {"role": "assistant", "content": None if self.names else ""}

    def _call_name(self) -> str | None:
        recipient = self.parser.current_recipient or ""
        name = recipient[len(_FUNCTIONS):] if recipient.startswith(_FUNCTIONS) else None
        return name if self.names and name in self.names else None

    def feed(self, token_ids: list[int]) -> dict:
        reasoning, content, calls = [], [], []
        for t in token_ids:
            if self.broken:
                break
            try:
                self.parser.process(int(t))
            except Exception:  # noqa: BLE001 - openai_harmony.HarmonyError: not harmony
                self.broken = True
                break
            if len(self.parser.messages) != self.seen:  # a message ended
                self.seen, self.in_call = len(self.parser.messages), False
            text = self.parser.last_content_delta
            if not text:
                continue
            channel = self.parser.current_channel
            name = self._call_name() if channel == "commentary" else None
            if channel == "analysis":
                reasoning.append(text)
            elif name is not None:
                if not self.in_call:
                    if self.max_calls and self.count >= self.max_calls:
                        continue
                    self.in_call = True
                    calls.append({"index": self.count, "id": new_call_id(),
                                  "type": "function",
                                  "function": {"name": name, "arguments": ""}})
                    self.count += 1
                if calls and calls[-1]["index"] == self.count - 1:
                    calls[-1]["function"]["arguments"] += text
                else:
                    calls.append({"index": self.count - 1, "function": {"arguments": text}})
            elif self.parser.current_recipient is None:
                content.append(text)  # the final channel, or a preamble on commentary
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = "".join(reasoning)
        if content:
            delta["content"] = "".join(content)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def read(self, text: str, token_ids: list[int], finish_reason: str | None
             ) -> tuple[dict, str | None]:
        """As tool_output.ChoiceReader.read, from the token ids."""
        delta = self.feed(token_ids)
        if finish_reason == "stop" and self.called:
            finish_reason = "tool_calls"
        return delta, finish_reason

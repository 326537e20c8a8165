"""OpenAI's Responses API (`POST /v1/responses`) over the chat path, as vLLM serves it.

A request becomes a chat request: `instructions` the system message, `input` (a string,
or a list of messages, function calls and their outputs) the conversation, function
`tools` and `tool_choice` the chat ones, `max_output_tokens` max_tokens, `text.format`
the response_format, and `reasoning.effort` the chat template's `reasoning_effort`
variable (what gpt-oss templates read). It is generated and read as chat is (thinking
by --reasoning-parser, calls by --tool-call-parser); the answer comes back as output
items: a `reasoning` item, a `message` with `output_text`, one `function_call` per call.

Streaming sends the Responses events in order (response.created, in_progress, then per
item output_item.added, its deltas, its done events, output_item.done, and at the end
response.completed, or response.incomplete when max_output_tokens cut it), each with its
sequence_number, built from the same deltas a chat stream sends.

Not kept: nothing is stored, so `previous_response_id` is refused (send the whole
conversation in `input`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from jetserve.server.streams import Joined
from jetserve.server.validation import InvalidArgument, show

EFFORTS = ("minimal", "low", "medium", "high")
# Chat fields as the Responses API names them, for errors raised on the chat request.
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}
_REFUSED = ("previous_response_id", "background", "conversation")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(where, f"{where} must be a string or a list of text parts, "
                                     f"got {show(content)}")
    out = []
    for k, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text",
                                                                "text")
                and isinstance(part.get("text"), str)):
            raise InvalidArgument(f"{where}[{k}]", f"{where}[{k}] must be a text part "
                                                   "({'type': 'input_text', 'text': ...}); "
                                                   f"other parts are not supported, got "
                                                   f"{show(part)}")
        out.append(part["text"])
    return "".join(out)


def input_messages(instructions: Any, items: Any) -> list[dict]:
    """`instructions` and `input` as chat messages."""
    msgs: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidArgument("instructions", "instructions must be a string, got "
                                                  f"{show(instructions)}")
        msgs.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidArgument("input", "input must be a string or a non-empty list of "
                                       f"items, got {show(items)}")
    for k, item in enumerate(items):
        where = f"input[{k}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and "role" in item:
            msgs.append({"role": item["role"],
                         "content": _text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier thinking: templates drop it from the history anyway
        else:
            raise InvalidArgument(where, f"{where} must be a message ({{'role', 'content'}}),"
                                         " a function_call or a function_call_output, got "
                                         f"{show(item)}")
    return msgs


def _tools(tools: Any) -> Any:
    if not isinstance(tools, list):
        return tools  # chat's checks say what is wrong
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function" and "function" not in t:
            t = {"type": "function", "function": {k: val for k, val in t.items()
                                                  if k != "type"}}
        out.append(t)
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request body as the chat request body it stands for."""
    for key in _REFUSED:
        if body.get(key):
            raise InvalidArgument(key, f"{key} is not supported: this server stores no "
                                       "responses; send the whole conversation in input")
    out: dict[str, Any] = {
        "messages": input_messages(body.get("instructions"), body.get("input")),
        "stream": bool(body.get("stream"))}
    for key in ("model", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k",
                "structured_outputs", "ignore_eos"):  # from top_k: extensions, as on chat
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    kwargs = dict(body.get("chat_template_kwargs") or {})
    reasoning = body.get("reasoning")
    if reasoning is not None:
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        if effort is not None and effort not in EFFORTS:
            raise InvalidArgument("reasoning.effort", "reasoning.effort must be one of "
                                                      f"{', '.join(EFFORTS)}, got {show(effort)}")
        if effort is not None:
            kwargs["reasoning_effort"] = effort
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        out["response_format"] = {"type": "json_object"}
    return out


def renamed(e: InvalidArgument) -> InvalidArgument:
    """A chat request's error in the Responses API's field names."""
    field = e.field or ""
    head = field.split("[")[0].split(".")[0]
    if head not in RENAMED:
        return e
    new = RENAMED[head] + field[len(head):]
    return InvalidArgument(new, str(e).replace(field, new, 1))


def output_items(message: dict) -> list[dict]:
    """A chat message (tool_output.message) as Responses output items."""
    items: list[dict] = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        items.append(call_item(_id("fc"), call["id"], call["function"]["name"],
                               call["function"]["arguments"], "completed"))
    return items


def reasoning_item(item_id: str, text: str | None) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [] if text is None else [{"type": "reasoning_text", "text": text}]}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response(rid: str, body: dict[str, Any], model: str, output: list[dict],
             finish_reason: str | None, usage: dict | None) -> dict:
    """The response object (`finish_reason` None: still in progress)."""
    status = ("in_progress" if finish_reason is None else
              "incomplete" if finish_reason == "length" else "completed")
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else None
    out = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
           "status": status, "output": output, "error": None,
           "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                  else None),
           "instructions": body.get("instructions"), "metadata": body.get("metadata"),
           "max_output_tokens": body.get("max_output_tokens"),
           "parallel_tool_calls": body.get("parallel_tool_calls", True),
           "temperature": body.get("temperature"), "top_p": body.get("top_p"),
           "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
           "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
           "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
           "store": False, "usage": None}
    if usage is not None:
        out["usage"] = {"input_tokens": usage["prompt_tokens"],
                        "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": usage["completion_tokens"],
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": usage["total_tokens"]}
    return out


class EventWriter:
    """Chat deltas (tool_output.ChoiceReader) -> Responses stream events, in order.

    One output item is open at a time: reasoning, a message or a function call; a delta
    of another kind closes it and opens the next."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict] = []  # finished output items
        self.open: dict | None = None  # the item being written
        self.text = ""  # its text or arguments so far

    async def events(self, deltas: AsyncIterator[Any], reader: Any,
                     respond: Callable[[list, str | None, Any], dict]) -> AsyncIterator[dict]:
        """The whole stream: `deltas` (the request's Delta objects) read by `reader`
        (openai_format.choice_reader); `respond(output, finish_reason, joined)` is the
        response object (joined: the streams.Joined of all deltas, None while going)."""
        yield self.event("response.created", response=respond([], None, None))
        yield self.event("response.in_progress", response=respond([], None, None))
        total = Joined()
        async for d in deltas:
            if d.finish_reason == "error":
                yield self.event("error", code="server_error",
                                 message=f"generation failed: {d.error}")
                return
            total.add(d)
            for e in self.delta(reader.read(d.text, d.token_ids, d.finish_reason)[0]):
                yield e
        for e in self.finish():
            yield e
        kind = "response.incomplete" if total.finish_reason == "length" else \
            "response.completed"
        yield self.event(kind, response=respond(self.items, total.finish_reason, total))

    def event(self, kind: str, **fields: Any) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def delta(self, delta: dict) -> list[dict]:
        out: list[dict] = []
        if delta.get("reasoning_content"):
            out += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._write("message", delta["content"])
        for entry in delta.get("tool_calls") or ():
            if entry.get("id") is not None:
                out += self._close()
                fn = entry["function"]
                out += self._start(call_item(_id("fc"), entry["id"], fn["name"], "",
                                             "in_progress"))
            out += self._write("function_call", entry["function"].get("arguments") or "")
        return out

    def finish(self) -> list[dict]:
        return self._close()

    def _where(self) -> dict:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _start(self, item: dict) -> list[dict]:
        self.open, self.text = item, ""
        out = [self.event("response.output_item.added", output_index=len(self.items),
                          item=item)]
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=_text_part("")))
        return out

    def _write(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        if not text and kind != "function_call":
            return out
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = (reasoning_item(_id("rs"), None) if kind == "reasoning"
                    else message_item(_id("msg"), None, "in_progress"))
            out += self._start(item)
        if not text:
            return out
        self.text += text
        name = {"reasoning": "response.reasoning_text.delta",
                "message": "response.output_text.delta",
                "function_call": "response.function_call_arguments.delta"}[kind]
        extra = {} if kind == "function_call" else {"content_index": 0}
        if kind == "message":
            extra["logprobs"] = []
        out.append(self.event(name, **self._where(), **extra, delta=text))
        return out

    def _close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        where, text, out = self._where(), self.text, []
        if item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                  text=text))
            item = reasoning_item(item["id"], text)
        elif item["type"] == "message":
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=_text_part(text)))
            item = message_item(item["id"], text, "completed")
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=text))
            item = {**item, "arguments": text, "status": "completed"}
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=item))
        self.items.append(item)
        self.open, self.text = None, ""
        return out

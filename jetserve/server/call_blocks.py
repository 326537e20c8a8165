"""Tool calls written in formats other than a JSON call object: read block by block.

A block opens at a marker and runs to its close marker (or, for pythonic, to the end of
the output). What is inside is read by the format's own parser, again and again as it
grows; each parse gives the calls so far as (name, arguments so far, done), the
arguments as JSON text that only ever grows, so they go out as they are written:

- qwen3_coder (Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n
  </parameter>...</function>\\n</tool_call>`, one call per block; an argument goes out
  when its `</parameter>` is written.
- glm45 (GLM-4.5): `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE
  </arg_value>...</tool_call>`, one call per block; an argument goes out when its
  `</arg_value>` is written.
  (Both: a value is text where the tool's schema says "string", else read as JSON when
  it is JSON.)
- deepseek_v3 (DeepSeek-V3): `<｜tool▁calls▁begin｜>` then calls
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>`,
  then `<｜tool▁calls▁end｜>`; ARGS (JSON) goes out as it is written, unjudged (as
  for the JSON formats: the client's json.loads judges it).
- pythonic (Llama 4 and others): the whole output is a Python list of calls,
  `[get_weather(city="Paris"), get_time(timezone="UTC")]`, keyword arguments of Python
  literals, never evaluated: while it is written, each argument goes out once a `,` or
  the call's `)` ends it (ast.literal_eval reads it); at the end the whole list is read
  again with ast.parse.

A block that turns out not to hold calls to the listed tools is content, verbatim.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

# (name, JSON arguments written so far, the call is complete)
Partial = tuple[str, str, bool]


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


class NotCall(Exception):
    """The block's text cannot be calls in the format."""


def _args_text(pairs: list[tuple[str, Any]], done: bool) -> str:
    """Arguments as JSON text that grows pair by pair: `{"a": 1`, `{"a": 1, "b": 2`, `}`."""
    if not pairs:
        return "{}" if done else ""
    body = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                     for k, v in pairs)
    return "{" + body + ("}" if done else "")


def _value(text: str, kind: Any) -> Any:
    """An argument written as text: kept as text where the schema says string, else read
    as JSON when it is JSON."""
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _pending(s: str, token: str, final: bool) -> bool:
    """`s` is still only a start of `token` (so say nothing yet), or NotCall."""
    if not final and token.startswith(s):
        return True
    raise NotCall


def _strip_newline(s: str) -> str:
    s = s[1:] if s.startswith("\n") else s
    return s[:-1] if s.endswith("\n") else s


_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def read_qwen3_coder(body: str, final: bool, types: Callable[[str, str], Any]) -> list[Partial]:
    s = body.lstrip()
    head = "<function="
    if not s.startswith(head):
        _pending(s, head, final)
        return []
    end = s.find(">")
    if end < 0:
        if final:
            raise NotCall
        return []
    name, rest = s[len(head):end], s[end + 1:]
    pairs = [(k, _value(_strip_newline(v), types(name, k))) for k, v in _PARAM.findall(rest)]
    done = "</function>" in rest
    if final and not done:
        raise NotCall
    return [(name, _args_text(pairs, done), done)]


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def read_glm45(body: str, final: bool, types: Callable[[str, str], Any]) -> list[Partial]:
    s = body.lstrip()
    ends = [k for k in (s.find("\n"), s.find("<arg_key>")) if k >= 0]
    if not ends:
        if not final:
            return []
        ends = [len(s)]
    name = s[:min(ends)].strip()
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise NotCall
    pairs = [(k.strip(), _value(v, types(name, k.strip()))) for k, v in _ARG.findall(s)]
    return [(name, _args_text(pairs, final), final)]


DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_FENCE_OPEN, _FENCE_CLOSE = "```json\n", "```"


def read_deepseek_v3(body: str, final: bool, types: Any = None) -> list[Partial]:
    out: list[Partial] = []
    s = body
    while True:
        s = s.lstrip()
        if not s:
            return out
        if not s.startswith(DS_CALL):
            _pending(s, DS_CALL, final)
            return out
        sep = s.find(DS_SEP)
        nl = s.find("\n", sep + 1) if sep >= 0 else -1
        if nl < 0:
            if final:
                raise NotCall
            return out
        name = s[sep + len(DS_SEP):nl].strip()
        rest = s[nl + 1:]
        if not rest.startswith(_FENCE_OPEN):
            _pending(rest, _FENCE_OPEN, final)
            return out
        rest = rest[len(_FENCE_OPEN):]
        close = rest.find(_FENCE_CLOSE)
        if close < 0:  # arguments still being written; hold back a fence's start
            if final:
                raise NotCall
            keep = next((n for n in range(len(_FENCE_CLOSE), 0, -1)
                         if rest.endswith(_FENCE_CLOSE[:n])), 0)
            return [*out, (name, rest[:len(rest) - keep].strip(), False)]
        args = rest[:close].strip()  # as written: streamed before it could be judged
        after = rest[close + len(_FENCE_CLOSE):].lstrip()
        if not after.startswith(DS_CALL_END):
            _pending(after, DS_CALL_END, final)
            return [*out, (name, args, False)]
        out.append((name, args, True))
        s = after[len(DS_CALL_END):]


def _pythonic_so_far(body: str) -> list[Partial]:
    """The calls of a list not yet closed, each keyword argument once its text is
    complete (a `,` or the call's `)` after it), read with ast.literal_eval."""
    out: list[Partial] = []
    depth, quote, escape, start = 0, "", False, 0
    name: str | None = None
    pairs: list[tuple[str, Any]] = []
    for k, c in enumerate(body):
        if quote:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif depth == 1 and c in ",)":  # an argument ends; `)`: the call too
            pairs += _keyword(body[start:k])
            start = k + 1
            if c == ")":
                out.append((name or "", _args_text(pairs, True), True))
                depth, name = 0, None
        elif c in "([{":
            if depth == 0:
                name, pairs = body[start:k].strip(" ,\n"), []
                if c != "(" or not name.isidentifier():
                    raise NotCall
                start = k + 1
            depth += 1
        elif c in ")]}":
            depth -= 1
    if name is not None and pairs:  # a call is sure once an argument reads as one
        out.append((name, _args_text(pairs, False), False))
    return out


def _keyword(piece: str) -> list[tuple[str, Any]]:
    """`key=literal` (or nothing) as [(key, value)]; NotCall for anything else."""
    if not piece.strip():
        return []
    key, eq, value = piece.partition("=")
    try:
        if not (eq and key.strip().isidentifier()):
            raise ValueError
        return [(key.strip(), ast.literal_eval(value.strip()))]
    except (ValueError, SyntaxError):
        raise NotCall from None


def read_pythonic(body: str, final: bool, types: Any = None) -> list[Partial]:
    if not final:
        if body.lstrip()[:1] not in ("", "]") and not body.lstrip()[:1].isidentifier():
            raise NotCall  # `[` then something no call starts with: plain text
        return _pythonic_so_far(body)
    try:
        tree = ast.parse("[" + body, mode="eval").body
    except SyntaxError:
        raise NotCall from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise NotCall
    out: list[Partial] = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and not node.args and all(k.arg for k in node.keywords)):
            raise NotCall
        try:
            pairs = [(k.arg, ast.literal_eval(k.value)) for k in node.keywords]
        except ValueError:
            raise NotCall from None
        out.append((node.func.id, _args_text(pairs, True), True))
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockFormat:
    """A block of calls: `open` ... `close` ("": the output's end), read by `read`.

    `at_start`: a block opens only at the output's start (leading whitespace aside)."""

    open: str
    close: str
    read: Callable[..., list[Partial]]
    at_start: bool = False


BLOCKS = {
    "qwen3_coder": BlockFormat(open="<tool_call>", close="</tool_call>", read=read_qwen3_coder),
    "glm45": BlockFormat(open="<tool_call>", close="</tool_call>", read=read_glm45),
    "deepseek_v3": BlockFormat(open=DS_CALLS, close=DS_CALLS_END, read=read_deepseek_v3),
    "pythonic": BlockFormat(open="[", close="", read=read_pythonic, at_start=True),
}

"""Chat `tools` and `tool_choice`: validated, handed to the chat template, and turned into
the constraint a forced call is generated under.

The call format (documented in the bundled model's MODEL.md, and the one Hermes- and
Qwen-style templates use): a call is the JSON object `{"name": NAME, "arguments": {...}}`.
- `tool_choice` "auto" (the default with tools): the model sees the tools through its chat
  template and may write calls as `<tool_call>{...}</tool_call>` in its text; they are
  parsed out of it (jetserve.server.tool_output).
- "required" or a named function: the whole output is one call object, constrained by a
  JSON schema (name from the list, arguments matching that function's `parameters`);
  "required" with `parallel_tool_calls` (the default) admits a JSON list of one or more
  call objects instead.
- "none": as if no tools were given.
`parallel_tool_calls` false: at most one call (auto reads no further than the first).
"auto" reads calls in the format the server's `--tool-call-parser` names
(jetserve.server.tool_formats; the bundled template's `<tool_call>` by default).

Templates that do not mention `tools` (and the default template) get the tools and any
calls in the history written as text in the format above, so the model sees them anyway.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

from jetserve.server.tool_formats import DEFAULT_PARSER, NAMES, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from jetserve.server.validation import InvalidArgument, check_text, show
from jetserve.structured import Constraint
from jetserve.structured.grammar import check_constraint

# OpenAI's own limits: 128 tools, names of 1-64 letters, digits, '_' or '-'.
MAX_TOOLS = 128
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")
HOWTO = ('To call a tool, answer with <tool_call>{"name": NAME, "arguments": ARGUMENTS}'
         "</tool_call>, ARGUMENTS a JSON object matching the parameters of the tool.")
# A forced call is written as json.dumps writes it (and as the templates show calls): no
# free whitespace, which a sampled model could otherwise fill until max_tokens.
_CALL_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# A function without `parameters` takes none (as OpenAI reads it): arguments are {}.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolPlan:
    """The tools of one chat request and how a call is made.

    Args:
      tools: the validated definitions ({"type": "function", "function": {...}}), as the
        chat template receives them.
      mode: "auto" (calls parsed from free text), "required" (one call to any tool) or
        "named" (one call to `name`).
      name: the function of mode "named".
      parallel: several calls may be made (OpenAI's parallel_tool_calls); False: one.
      parser: the format calls are read in, in mode auto (tool_formats.PARSERS).
    """

    tools: tuple[dict, ...]
    mode: str
    name: str | None = None
    parallel: bool = True
    parser: str = DEFAULT_PARSER

    def __post_init__(self):
        if self.mode not in ("auto", "required", "named"):
            raise ValueError(f"mode must be auto, required or named, got {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("name is given exactly when mode is 'named'")
        if self.parser not in NAMES:
            raise ValueError(f"parser must be one of {', '.join(NAMES)}, "
                             f"got {self.parser!r}")

    @property
    def forced(self) -> bool:
        """The output is one call object, nothing else."""
        return self.mode != "auto"

    def constraint(self) -> Constraint | None:
        """The JSON schema a forced call is generated under (a list of one or more calls
        in mode required with parallel calls); None in mode auto."""
        if not self.forced:
            return None
        fns = [t["function"] for t in self.tools
               if self.mode == "required" or t["function"]["name"] == self.name]
        listed = self.mode == "required" and self.parallel
        at = "#/items" if listed else "#"
        if len(fns) == 1:
            schema = _call_schema(fns[0], f"{at}/properties/arguments")
        else:
            schema = {"anyOf": [_call_schema(f, f"{at}/anyOf/{k}/properties/arguments")
                                for k, f in enumerate(fns)]}
        if listed:
            schema = {"type": "array", "items": schema, "minItems": 1}
        schema["x-guidance"] = _CALL_FORMAT
        return Constraint(kind="json_schema", value=schema, field="tool_choice")


def output_constraint(plan: ToolPlan | None, other: Constraint | None) -> Constraint | None:
    """What a chat request's output must match: a forced call's schema, or `other` (from
    response_format and the like); both at once is refused."""
    if plan is None or not plan.forced:
        return other
    if other is not None:
        raise InvalidArgument("tool_choice", f"tool_choice {plan.mode!r} forces a tool call, "
                                             f"and {other.field} constrains the output too; "
                                             "give one of them")
    return plan.constraint()


def _call_schema(fn: dict, at: str) -> dict:
    """{"name": const, "arguments": parameters}; the parameters' local $refs are moved to
    where the parameters now sit (`at`), so a pydantic schema's $defs still resolve."""
    params = _move_refs(copy.deepcopy(fn.get("parameters") or _NO_PARAMETERS), at)
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _move_refs(node: Any, at: str) -> Any:
    if isinstance(node, dict):
        for k, val in node.items():
            if k == "$ref" and isinstance(val, str) and val.startswith("#"):
                node[k] = at + val[1:]
            else:
                _move_refs(val, at)
    elif isinstance(node, list):
        for val in node:
            _move_refs(val, at)
    return node


def check_schema(schema: Any, field: str) -> None:
    """A JSON schema the grammar engine compiles, or InvalidArgument with its message."""
    try:
        check_constraint(Constraint(kind="json_schema", value=schema, field=field))
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def _check_tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise InvalidArgument(where, f"{where} must be an object "
                                     f"{{'type': 'function', 'function': {{...}}}}, "
                                     f"got {show(tool)}")
    if tool.get("type") != "function":
        raise InvalidArgument(f"{where}.type", f"{where}.type must be 'function', "
                                               f"got {show(tool.get('type'))}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise InvalidArgument(f"{where}.function", f"{where}.function must be an object with "
                                                   f"name, description and parameters, "
                                                   f"got {show(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise InvalidArgument(f"{where}.function.name",
                              f"{where}.function.name must be 1 to 64 letters, digits, '_' "
                              f"or '-', got {show(name)}")
    out: dict[str, Any] = {"name": name}
    if fn.get("description") is not None:
        out["description"] = check_text(fn["description"], f"{where}.function.description")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise InvalidArgument(f"{where}.function.parameters",
                                  f"{where}.function.parameters must be a JSON schema "
                                  f"object, got {show(params)}")
        out["parameters"] = params
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise InvalidArgument(f"{where}.function.strict", f"{where}.function.strict must be "
                                                          f"a boolean, got {show(fn['strict'])}")
    return {"type": "function", "function": out}


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise InvalidArgument("tools", f"tools must be a list of tool definitions, "
                                       f"got {show(tools)}")
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"tools has {len(tools)} tools; at most {MAX_TOOLS} "
                                       "are allowed")
    out, seen = [], set()
    for i, t in enumerate(tools):
        tool = _check_tool(t, i)
        name = tool["function"]["name"]
        if name in seen:
            raise InvalidArgument(f"tools[{i}].function.name",
                                  f"tools[{i}].function.name {name!r} is given twice; "
                                  "tool names must be unique")
        seen.add(name)
        out.append(tool)
    return out


def _check_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    """tool_choice -> (mode, name)."""
    if isinstance(choice, str) and choice in CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise InvalidArgument("tool_choice", "tool_choice must be 'none', 'auto', 'required' "
                              "or {'type': 'function', 'function': {'name': ...}}, "
                              f"got {show(choice)}")
    if fn["name"] not in names:
        raise InvalidArgument("tool_choice", f"tool_choice names the function "
                              f"{show(fn['name'])}, which is not in tools "
                              f"(tools has {show(names)})")
    return "named", fn["name"]


def plan_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any = None,
               parser: str = DEFAULT_PARSER) -> ToolPlan | None:
    """A request's `tools`, `tool_choice` and `parallel_tool_calls` (None: true), checked;
    None when no tool is in play (no tools, an empty list, or tool_choice "none").
    `parser`: the server's --tool-call-parser."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidArgument("parallel_tool_calls", "parallel_tool_calls must be true or "
                                                     f"false, got {show(parallel_tool_calls)}")
    checked = _check_tools(tools) if tools is not None else []
    if not checked:
        if tool_choice not in (None, "none"):
            raise InvalidArgument("tool_choice", f"tool_choice {show(tool_choice)} needs "
                                                 "tools; give tools or leave tool_choice out")
        return None
    names = [t["function"]["name"] for t in checked]
    mode, name = _check_choice("auto" if tool_choice is None else tool_choice, names)
    if mode == "none":
        return None
    plan = ToolPlan(tools=tuple(checked), mode=mode, name=name,
                    parallel=parallel_tool_calls is not False, parser=parser)
    if plan.forced:  # these are enforced: refused here, naming the tool, if they cannot be
        for i, t in enumerate(checked):
            if "parameters" in t["function"] and (mode == "required" or names[i] == name):
                check_schema(t["function"]["parameters"], f"tools[{i}].function.parameters")
    return plan


# ---- the conversation's history ---------------------------------------------------------


def message_fields(m: dict, role: str, where: str) -> dict:
    """The tool fields of one chat message, checked: an assistant's `tool_calls` (each
    call's arguments as a dict, as Hugging Face templates expect, when they are a JSON
    object), a tool message's `tool_call_id` and `name`."""
    out: dict[str, Any] = {}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise InvalidArgument(f"{where}.tool_calls", f"{where}.tool_calls must be a list, "
                                                         f"got {show(calls)}")
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{k}]")
                             for k, c in enumerate(calls)]
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                out[key] = check_text(m[key], f"{where}.{key}")
    return out


def _history_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
        raise InvalidArgument(where, f"{where} must be {{'type': 'function', 'function': "
                                     f"{{'name': ..., 'arguments': ...}}}}, got {show(call)}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args
    elif not isinstance(args, dict):
        raise InvalidArgument(f"{where}.function.arguments",
                              f"{where}.function.arguments must be a JSON string or an "
                              f"object, got {show(args)}")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def call_text(name: str, arguments: Any) -> str:
    """One call written in the documented format."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {args}}}{TOOL_CALL_CLOSE}'


def as_text(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template that knows nothing of tools: the tools listed in a
    system message first, each earlier call written into its message's content."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") or ()
        text = "\n".join([m["content"]] * bool(m["content"]) +
                         [call_text(c["function"]["name"], c["function"]["arguments"])
                          for c in calls])
        out.append({"role": m["role"], "content": text})
    if tools:
        listing = "\n".join(["You can call these tools:"] +
                            [json.dumps(t, ensure_ascii=False) for t in tools] + [HOWTO])
        if out and out[0]["role"] == "system":  # one system message: templates want that
            out[0]["content"] = f"{out[0]['content']}\n\n{listing}"
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out

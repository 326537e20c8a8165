"""Structured output on the OpenAI HTTP API (and batch rows): request fields -> Constraint,
and the OpenAI fields jetserve does not implement, refused by name.

Accepted, one per request (a 400 names the second when several are given):
  response_format   {"type": "text" | "json_object"} or
                    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
  structured_outputs  vLLM's object: exactly one of json (a schema), regex, choice,
                    grammar (Lark or GBNF), json_object (true)
  guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older fields
The constraint is compiled here without the vocabulary (so a bad schema, regex or grammar
gets a 400 naming its field, with llguidance's message) and again at admission over the
served vocabulary.

`strict` in a json_schema is accepted either way: the schema is always enforced token by
token, so non-strict output is never looser than strict.
"""

from __future__ import annotations

from typing import Any

from jetserve.server.validation import InvalidArgument, show
from jetserve.structured import Constraint
from jetserve.structured.grammar import check_constraint

CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
_GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
         "json_object": "json_object"}
# OpenAI request fields that would change the answer and that jetserve does not do; a
# request naming one is refused rather than answered as if it were absent. (Chat `tools`,
# `tool_choice` and `parallel_tool_calls` belong with tool calling.)
UNIMPLEMENTED = ("audio", "function_call", "functions", "modalities", "prediction",
                 "reasoning_effort", "verbosity", "web_search_options")


def refuse_unimplemented(extra: dict[str, Any] | None) -> None:
    """400 naming the first OpenAI field of `extra` (a request's unmodelled fields) that
    jetserve does not implement; `modalities: ["text"]` asks for nothing more."""
    for name in UNIMPLEMENTED:
        value = (extra or {}).get(name)
        if value is None or (name == "modalities" and value == ["text"]):
            continue
        raise InvalidArgument(name, f"{name} is not implemented by this server (got "
                                    f"{show(value, 80)}); leave it out")


def constraint_of(r: Any) -> Constraint | None:
    """The request's constraint (None: free text), checked; InvalidArgument names the
    field at fault."""
    given = [f for f in CONSTRAINT_FIELDS if getattr(r, f, None) is not None
             and not (f == "response_format" and _is_text(r.response_format))]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgument(given[1], f"{given[1]} and {given[0]} both constrain the "
                                        "output; give one of them")
    f = given[0]
    value = getattr(r, f)
    if f == "response_format":
        c = _response_format(value)
    elif f == "structured_outputs":
        c = _structured_outputs(value)
    else:
        c = _make(_GUIDED[f], value, f)
    return _checked(c)


def _checked(c: Constraint) -> Constraint:
    """c, once llguidance compiles it (without the vocabulary: the orchestrator compiles
    it again over the served one at admission)."""
    try:
        check_constraint(c)
    except ValueError as e:
        raise InvalidArgument(c.field, str(e)) from None
    return c


def _is_text(rf: Any) -> bool:
    return isinstance(rf, dict) and rf.get("type") == "text" and len(rf) == 1


def _make(kind: str, value: Any, field: str) -> Constraint:
    try:
        return Constraint(kind=kind, value=value, field=field)
    except ValueError as e:
        raise InvalidArgument(field, str(e)) from None


def _response_format(rf: Any) -> Constraint:
    if not isinstance(rf, dict):
        raise InvalidArgument("response_format", f"response_format must be an object, got "
                                                 f"{show(rf, 80)}")
    kind = rf.get("type")
    if kind == "json_object" and set(rf) == {"type"}:
        return _make("json_object", None, "response_format")
    if kind != "json_schema":
        raise InvalidArgument("response_format.type", "response_format.type must be 'text', "
                              f"'json_object' or 'json_schema', got {show(kind, 80)}")
    unknown = set(rf) - {"type", "json_schema"}
    if unknown:
        name = f"response_format.{sorted(unknown)[0]}"
        raise InvalidArgument(name, f"{name} is not a response_format field")
    js = rf.get("json_schema")
    field = "response_format.json_schema"
    if not isinstance(js, dict):
        raise InvalidArgument(field, f"{field} must be an object with a 'schema', got "
                                     f"{show(js, 80)}")
    if not isinstance(js.get("name", ""), str):
        raise InvalidArgument(f"{field}.name", f"{field}.name must be a string")
    if not isinstance(js.get("strict", False), (bool, type(None))):
        raise InvalidArgument(f"{field}.strict", f"{field}.strict must be true or false, "
                                                 f"got {show(js['strict'], 80)}")
    if "schema" not in js:
        raise InvalidArgument(f"{field}.schema", f"{field}.schema is missing: give the "
                                                 "JSON schema the output must match")
    return _make("json_schema", js["schema"], f"{field}.schema")


def _structured_outputs(so: Any) -> Constraint:
    if not isinstance(so, dict):
        raise InvalidArgument("structured_outputs", "structured_outputs must be an object, "
                                                    f"got {show(so, 80)}")
    unknown = sorted(set(so) - set(_VLLM))
    if unknown:
        name = f"structured_outputs.{unknown[0]}"
        raise InvalidArgument(name, f"{name} is not implemented by this server; give one "
                                    f"of {', '.join(_VLLM)}")
    given = [k for k, v in so.items() if v is not None and v is not False]
    if len(given) != 1:
        raise InvalidArgument("structured_outputs", "structured_outputs must give exactly "
                                                    f"one of {', '.join(_VLLM)}, got "
                                                    f"{given or 'none'}")
    k = given[0]
    if k == "json_object":
        if so[k] is not True:
            raise InvalidArgument("structured_outputs.json_object",
                                  "structured_outputs.json_object must be true")
        return _make("json_object", None, "structured_outputs.json_object")
    return _make(_VLLM[k], so[k], f"structured_outputs.{k}")


_PROTO = {"json_schema": "json_schema", "json_object": "json_object", "regex": "regex",
          "choice": "choice", "grammar": "grammar"}


def constraint_of_proto(r: Any) -> Constraint | None:
    """A gRPC DecodeRequest's `constraint` oneof (protos/jetstream.proto), checked."""
    which = r.WhichOneof("constraint")
    if which is None:
        return None
    value = getattr(r, which)
    if which == "json_object":
        if not value:
            raise InvalidArgument("json_object", "json_object must be true when set")
        value = None
    elif which == "choice":
        value = list(value.choices)
    return _checked(_make(_PROTO[which], value, which))

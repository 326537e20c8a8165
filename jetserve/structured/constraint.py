"""`Constraint`: the shape a request's generated text must take.

Servers build one from `response_format`, `structured_outputs`, the older `guided_*` fields,
a forced tool call, or the gRPC extension fields; the orchestrator compiles it into a
grammar matcher at admission. This module only checks that the value has the right Python
type for its kind; whether a schema, regex or grammar compiles is decided by the grammar
engine at admission (an invalid one is refused there, naming the field).
"""

from __future__ import annotations

import dataclasses
import json

# json_schema: a JSON schema (dict, or its JSON text); json_object: any JSON object
# (value None); regex: a regular expression the whole output matches; choice: one of a
# list of strings; grammar: a Lark grammar (llguidance's dialect) as text.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constraint:
    """What the output must match.

    Args:
      kind: one of CONSTRAINT_KINDS.
      value: the schema (a dict; JSON text is parsed), regex or grammar text, or the
        choices (a non-empty sequence of strings); None for json_object.
      field: the request field it came from ("response_format", "guided_regex", ...),
        named in errors so the client sees which of its fields was wrong.
    """

    kind: str
    value: object = None
    field: str = "constraint"

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"{self.field}: constraint kind must be one of "
                             f"{', '.join(CONSTRAINT_KINDS)}, got {self.kind!r}")
        check = getattr(self, f"_check_{self.kind}")
        object.__setattr__(self, "value", check(self.value))

    def _check_json_schema(self, v):
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.field}: the JSON schema is not valid JSON: {e}") from e
        if not isinstance(v, (dict, bool)):
            raise ValueError(f"{self.field}: a JSON schema must be an object, got "
                             f"{type(v).__name__}")
        return v

    def _check_json_object(self, v):
        if v is not None:
            raise ValueError(f"{self.field}: json_object takes no value, got {v!r}")
        return None

    def _text(self, v, what: str):
        if not isinstance(v, str) or not v:
            raise ValueError(f"{self.field}: {what} must be a non-empty string, got {v!r}")
        return v

    def _check_regex(self, v):
        return self._text(v, "a regex")

    def _check_grammar(self, v):
        return self._text(v, "a grammar")

    def _check_choice(self, v):
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ValueError(f"{self.field}: choice must be a list of strings, got {v!r}")
        out = tuple(v)
        if not out:
            raise ValueError(f"{self.field}: choice is empty; give at least one string")
        for i, s in enumerate(out):
            if not isinstance(s, str) or not s:
                raise ValueError(f"{self.field}[{i}] must be a non-empty string, got {s!r}")
        return out

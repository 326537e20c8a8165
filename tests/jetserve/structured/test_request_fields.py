"""Request fields -> Constraint (jetserve/server/structured_fields.py), as the HTTP server
and batch rows read them: each spelling, one constraint per request, and errors naming
the field."""

import types

import pytest

from engines.mock_engine import ByteTokenizer
from jetserve.batch.rows import RowError, build_job
from jetserve.server.structured_fields import (
    CONSTRAINT_FIELDS,
    constraint_of,
    refuse_unimplemented,
)
from jetserve.server.validation import InvalidArgument, ModelLimits

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
LIMITS = ModelLimits(vocab_size=256, max_prefill_length=32, max_seq_len=48, bos_id=None,
                     eos_ids=(0,), top_logprobs=4, tokenizer=ByteTokenizer(eos_ids=(0,)))


def body(**kw):
    return types.SimpleNamespace(**{**{f: None for f in CONSTRAINT_FIELDS}, **kw})


@pytest.mark.parametrize("fields, kind, value, field", [
    (dict(response_format={"type": "json_object"}), "json_object", None, "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "strict": True, "schema": SCHEMA}}), "json_schema", SCHEMA,
     "response_format.json_schema.schema"),
    (dict(structured_outputs={"json": SCHEMA}), "json_schema", SCHEMA, "structured_outputs.json"),
    (dict(structured_outputs={"regex": "a+"}), "regex", "a+", "structured_outputs.regex"),
    (dict(structured_outputs={"choice": ["x", "y"]}), "choice", ("x", "y"),
     "structured_outputs.choice"),
    (dict(structured_outputs={"grammar": 'start: "a"'}), "grammar", 'start: "a"',
     "structured_outputs.grammar"),
    (dict(structured_outputs={"json_object": True}), "json_object", None,
     "structured_outputs.json_object"),
    (dict(guided_json='{"type": "object"}'), "json_schema", {"type": "object"}, "guided_json"),
    (dict(guided_regex="a+"), "regex", "a+", "guided_regex"),
    (dict(guided_choice=["x"]), "choice", ("x",), "guided_choice"),
    (dict(guided_grammar='start: "a"'), "grammar", 'start: "a"', "guided_grammar"),
])
def test_every_spelling(fields, kind, value, field):
    c = constraint_of(body(**fields))
    assert (c.kind, c.value, c.field) == (kind, value, field)


def test_text_is_no_constraint():
    assert constraint_of(body()) is None
    assert constraint_of(body(response_format={"type": "text"})) is None


@pytest.mark.parametrize("fields, field", [
    (dict(response_format="json"), "response_format"),
    (dict(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA},
                           "extra": 1}), "response_format.extra"),
    (dict(response_format={"type": "json_schema", "json_schema": {
        "schema": SCHEMA, "strict": "yes"}}), "response_format.json_schema.strict"),
    (dict(structured_outputs={"json_object": False}), "structured_outputs"),
    (dict(guided_regex="a", structured_outputs={"regex": "b"}), "guided_regex"),
    (dict(guided_json={"type": "object", "minProperties": "x"}), "guided_json"),
    (dict(guided_choice=["a", 3]), "guided_choice"),  # the message says [1]
])
def test_errors_name_the_field(fields, field):
    with pytest.raises(InvalidArgument) as e:
        constraint_of(body(**fields))
    assert e.value.field == field and str(e.value).startswith(field)


def test_unimplemented_openai_fields_are_refused_by_name():
    refuse_unimplemented({"user": "u", "metadata": {}, "modalities": ["text"]})  # no effect
    for name, value in (("audio", {}), ("prediction", {"type": "content"}),
                        ("functions", []), ("verbosity", "low")):
        with pytest.raises(InvalidArgument) as e:
            refuse_unimplemented({name: value})
        assert e.value.field == name and str(e.value).startswith(f"{name} is not implemented")


def test_batch_rows_take_the_same_fields():
    j = build_job({"id": 1, "prompt": "hi", "guided_regex": "[ab]+"}, LIMITS,
                  default_max_tokens=4)
    assert (j.request.constraint.kind, j.request.constraint.field) == ("regex", "guided_regex")
    j = build_job({"id": 2, "prompt": "hi", "response_format": {"type": "json_object"}},
                  LIMITS, default_max_tokens=4)
    assert j.request.constraint.kind == "json_object"
    with pytest.raises(RowError, match="^structured_outputs.regex: invalid regex"):
        build_job({"id": 3, "prompt": "hi", "structured_outputs": {"regex": "(a"}}, LIMITS,
                  default_max_tokens=4)

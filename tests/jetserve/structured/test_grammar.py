"""Constraints compiled by llguidance over the bundled model's sentencepiece vocabulary
(jetserve/structured/grammar.py, vocabulary.py): what each kind allows, and the errors
that name the request field."""

import json

import numpy as np
import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.structured import Constraint
from jetserve.structured.grammar import compile_constraint
from jetserve.tokenizer import load_tokenizer

V = 4096


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(BUNDLED_DIR)


def allowed(g) -> list[int]:
    return np.flatnonzero(np.unpackbits(g.mask_row().view(np.uint8), bitorder="little")[:V])


def text_of(tok, ids) -> str:
    return b"".join(tok.token_bytes(i) for i in ids).decode()


def walk(tok, g, pick) -> list[int] | None:
    """Takes tokens (pick(allowed ids) -> id) until the grammar is complete or only EOS
    may follow; None when that takes more than 100 tokens."""
    ids = []
    while not g.stopped:
        if len(ids) == 100:
            return None
        ok = [i for i in allowed(g) if i not in tok.eos_ids]
        if not ok:
            break
        ids.append(pick(ok))
        assert g.advance(ids[-1])
    return ids


@pytest.mark.parametrize("kind, value, check", [
    ("regex", r"[0-9]{3}-[a-z]{2}", lambda s: len(s) == 6 and s[3] == "-" and s[:3].isdigit()),
    ("choice", ["yes", "no", "maybe"], lambda s: s in ("yes", "no", "maybe")),
    ("json_object", None, lambda s: isinstance(json.loads(s), dict)),
    ("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"], "additionalProperties": False},
     lambda s: list(json.loads(s)) == ["n"] and isinstance(json.loads(s)["n"], int)),
    ("grammar", 'start: "a" ("b" | "c")+ "!"', lambda s: s[0] == "a" and s[-1] == "!"),
])
def test_any_walk_through_the_mask_matches(tok, kind, value, check):
    rng = np.random.default_rng(0)
    closing = lambda ok: max(ok, key=lambda i: b"}" in tok.token_bytes(i))  # ends JSON
    finished = 0
    for pick in (min, max, lambda ok: int(rng.choice(ok)), closing):
        g = compile_constraint(Constraint(kind=kind, value=value), tok, V)
        ids = walk(tok, g, pick)
        if ids is None:
            continue  # a walk that never closes the structure (JSON may nest forever)
        finished += 1
        if not g.stopped:  # only EOS may follow: the structure is complete
            assert set(allowed(g).tolist()) <= set(tok.eos_ids)
        assert check(text_of(tok, ids)), text_of(tok, ids)
    assert finished >= 2


def test_eos_only_where_the_grammar_may_end(tok):
    g = compile_constraint(Constraint(kind="regex", value="ab+"), tok, V)
    assert not set(tok.eos_ids) & set(allowed(g).tolist())
    assert g.advance(tok.encode("a", add_bos=False)[-1]) and not g.stopped
    assert not set(tok.eos_ids) & set(allowed(g).tolist())


@pytest.mark.parametrize("kind, value, field, words", [
    ("regex", "(ab", "guided_regex", "unclosed group"),
    ("json_schema", {"type": "foo"}, "response_format", "foo"),
    ("grammar", "start: foo(", "structured_outputs.grammar", "Expected"),
])
def test_an_invalid_constraint_names_the_field_and_llguidance_says_why(tok, kind, value,
                                                                          field, words):
    with pytest.raises(ValueError) as e:
        compile_constraint(Constraint(kind=kind, value=value, field=field), tok, V)
    assert str(e.value).startswith(f"{field}: invalid") and words in str(e.value)

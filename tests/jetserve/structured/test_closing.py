"""Every constrained kind within max_tokens (jetserve/structured/closing.py): the search
finds the shortest of a choice's answers and completions the grammar accepts; tokens drawn
at random from the narrowed masks of the bundled vocabulary (any allowed token, however
unlikely) always give a whole answer within the budget (ended by the grammar or EOS, or
one the grammar accepts as it stands where it may go on), for a strict schema, a list of
forced tool calls, a choice, a regex and a nested schema, down to the minimum; a budget
below the minimum is refused naming max_tokens."""

import json
import re

import numpy as np
import pytest
from pydantic import BaseModel, ConfigDict

from jetserve.model_loading import BUNDLED_DIR
from jetserve.request import InvalidArgument
from jetserve.server.tool_calls import ToolPlan
from jetserve.structured import Constraint
from jetserve.structured.closing import shortest
from jetserve.structured.grammar import compile_constraint
from jetserve.tokenizer import load_tokenizer

V = 4096


class Note(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str
    body: str
    tags: list[str]
    score: float


TOOLS = tuple({"type": "function", "function": {"name": n, "parameters": p}} for n, p in (
    ("get_weather", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}),
    ("get_time", {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                  "required": ["tz"]})))
NESTED = {"type": "array", "items": {"type": "object", "properties": {
    "a": {"type": "array", "items": {"type": "string"}}}, "required": ["a"]}}
LONG_AND_SHORT = ["an answer of a great many words, far longer than the budget", "no"]


def _calls_ok(text):
    calls = json.loads(text)
    return calls and all(c["name"] in ("get_weather", "get_time") for c in calls)


CASES = {  # name -> (constraint, check of the answer's text)
    "schema": (Constraint(kind="json_schema", value=Note.model_json_schema()),
               lambda t: isinstance(Note.model_validate_json(t), Note)),
    "tool calls": (ToolPlan(tools=TOOLS, mode="required").constraint(), _calls_ok),
    "named call": (ToolPlan(tools=TOOLS, mode="named", name="get_weather").constraint(),
                   lambda t: json.loads(t)["arguments"]["unit"] in ("celsius", "fahrenheit")),
    "choice": (Constraint(kind="choice", value=LONG_AND_SHORT), lambda t: t in LONG_AND_SHORT),
    "regex": (Constraint(kind="regex", value="[a-z ]*b"),
              lambda t: re.fullmatch("[a-z ]*b", t)),
    "nested": (Constraint(kind="json_schema", value=NESTED),
               lambda t: isinstance(json.loads(t), list)),
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_DIR)


def test_the_search_finds_the_shortest_choice_and_whole_answers(tokenizer):
    g = compile_constraint(CASES["choice"][0], tokenizer, V)
    assert shortest(g.matcher, g.budget._byte_token) == (b"no", True)
    for name in ("schema", "tool calls", "named call", "nested"):
        g = compile_constraint(CASES[name][0], tokenizer, V)
        text, stopped = shortest(g.matcher, g.budget._byte_token)
        assert stopped and CASES[name][1](text.decode())


def _sample(tokenizer, constraint, budget, seed):
    rng = np.random.default_rng(seed)
    g = compile_constraint(constraint, tokenizer, V)
    g.check_fits(budget)
    text = b""
    for used in range(budget):
        row = g.mask_row(remaining=budget - used)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V])
        t = int(rng.choice(allowed))
        if t in tokenizer.eos_ids:
            return text.decode(), True
        assert g.advance(t)
        text += tokenizer.token_bytes(t)
        if g.stopped:
            return text.decode(), True
    return text.decode(), g.matcher.is_accepting()  # cut by max_tokens, but whole


@pytest.mark.parametrize("name", CASES)
def test_random_tokens_from_the_narrowed_mask_close_within_the_budget(tokenizer, name):
    constraint, check = CASES[name]
    least = compile_constraint(constraint, tokenizer, V).budget.minimum()
    for budget in (least, least + 3, 2 * least + 10, 60):
        for seed in range(4):
            text, closed = _sample(tokenizer, constraint, max(budget, least), seed)
            assert closed, (name, budget, seed, text)
            assert check(text), text


def test_a_budget_below_the_minimum_is_refused_naming_max_tokens(tokenizer):
    g = compile_constraint(CASES["schema"][0], tokenizer, V)
    least = g.budget.minimum()
    g.check_fits(least)
    with pytest.raises(InvalidArgument) as e:
        g.check_fits(least - 1)
    assert e.value.field == "max_tokens" and f"at least {least}" in str(e.value)


def test_far_from_the_end_the_mask_is_the_grammars(tokenizer):
    g = compile_constraint(CASES["schema"][0], tokenizer, V)
    for t in tokenizer.encode('{"title":"a', add_bos=False):
        assert g.advance(t)
    assert np.array_equal(g.mask_row(remaining=200), g.mask_row())
    assert not np.array_equal(g.mask_row(remaining=20), g.mask_row())

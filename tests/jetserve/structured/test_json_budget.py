"""json_object within max_tokens (jetserve/structured/json_budget.py): the closer's
completion of every prefix of real JSON parses, no piece of text lengthens it by more than
its growth bound, and tokens drawn at random from the narrowed mask of the bundled
vocabulary always give a whole object within the budget."""

import json
import random

import numpy as np
import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.structured import Constraint
from jetserve.structured.grammar import compile_constraint
from jetserve.structured.json_budget import GrowthTable, JsonCloser
from jetserve.tokenizer import load_tokenizer


def _value(rng: random.Random, depth: int):
    kind = rng.choice(["str", "num", "lit", "obj", "arr"] if depth < 3 else ["str", "num", "lit"])
    if kind == "str":
        return "".join(rng.choice(['a', 'Z', ' ', '"', '\\', '\n', '\u00e9', '{', ':', 'e'])
                       for _ in range(rng.randrange(5)))
    if kind == "num":
        return rng.choice([0, -7, 12, 3.5, -0.25, 1e21, -2.5e-8])
    if kind == "lit":
        return rng.choice([True, False, None])
    if kind == "arr":
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {_value_key(rng): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _value_key(rng):
    return "".join(rng.choice(["k", '"', "\\", "\u00fc", "\t"]) for _ in range(rng.randrange(4)))


def _texts(n=40):
    rng = random.Random(0)
    return [json.dumps({_value_key(rng): _value(rng, 1) for _ in range(rng.randrange(1, 4))},
                       separators=(",", ":"), ensure_ascii=rng.random() < 0.5).encode()
            for _ in range(n)]


def _closer(data: bytes) -> JsonCloser:
    c = JsonCloser()
    c.feed(data)
    return c


def test_every_prefix_closes_to_an_object():
    for text in _texts():
        for i in range(len(text) + 1):
            closing = _closer(text[:i]).closing()
            try:
                done = json.loads(text[:i] + closing)
            except (json.JSONDecodeError, UnicodeDecodeError):
                if text[i - 1] >= 0x80:  # inside a multi-byte character: no text to close yet
                    continue
                raise AssertionError((text[:i], closing)) from None
            assert isinstance(done, dict)
        assert _closer(text).closing() == b""


def test_no_piece_of_text_grows_the_completion_past_its_bound():
    for text in _texts():
        pieces = [text[i:j] for i in range(len(text)) for j in range(i + 1, min(i + 7, len(text)) + 1)]
        table = GrowthTable(pieces)
        k = 0
        for i in range(len(text)):
            before = _closer(text[:i])
            for j in range(i + 1, min(i + 7, len(text)) + 1):
                grown = len(_closer(text[:j]).closing()) - len(before.closing())
                bound = (table.in_string if before.in_string and not before.pending
                         else table.anywhere)[k]
                assert grown <= bound, (text[:i], text[i:j])
                k += 1


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(BUNDLED_DIR)


@pytest.mark.parametrize("budget", [2, 3, 5, 9, 17, 40])
def test_random_tokens_from_the_narrowed_mask_close_within_the_budget(tokenizer, budget):
    V = 4096
    for seed in range(6):
        rng = np.random.default_rng(seed)
        g = compile_constraint(Constraint(kind="json_object"), tokenizer, V)
        text = b""
        for used in range(budget):
            row = g.mask_row(remaining=budget - used)
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V])
            t = int(rng.choice(allowed))  # any allowed token, however unlikely
            assert g.advance(t)
            if t in tokenizer.eos_ids:
                break
            text += tokenizer.token_bytes(t)
            if g.stopped:
                break
        assert g.stopped or g.matcher.is_accepting(), (budget, seed, text)
        assert isinstance(json.loads(text), dict)


def test_far_from_the_end_the_mask_is_the_grammars(tokenizer):
    g = compile_constraint(Constraint(kind="json_object"), tokenizer, 4096)
    for t in tokenizer.encode('{"a', add_bos=False):
        assert g.advance(t)
    assert not np.array_equal(g.mask_row(remaining=4), g.mask_row(remaining=200))
    assert np.array_equal(g.mask_row(remaining=200), g.mask_row())

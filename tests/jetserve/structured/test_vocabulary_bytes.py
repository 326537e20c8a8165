"""What llguidance is told about a vocabulary, for every tokenizer kind the loader accepts:
each id's bytes are what decoding that id after a fixed context adds (the tokenizer
library's own decode is the reference), special ids are exactly the library's special
ones, text llguidance tokenizes spells that text back, and a grammar walked by uniformly
random allowed tokens always decodes to a match (what a random-weight model does)."""

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import Tokenizer

from jetserve.structured.constraint import Constraint
from jetserve.structured.grammar import compile_constraint
from jetserve.structured.vocabulary import ll_tokenizer
from jetserve.tokenizer import load_tokenizer
from tests.jetserve.structured import tokenizer_kinds as kinds

CONTEXT = "x = 1\n"
KINDS = {
    # Llama 2 / Mistral: byte fallback, dummy "▁" prefix, an added (user) symbol
    "sentencepiece_llama": lambda d: kinds.write_sentencepiece(d, user_symbols=("<tool>",)),
    # no byte fallback, sentencepiece's default normalizer, unigram pieces
    "sentencepiece_plain": lambda d: kinds.write_sentencepiece(
        d, byte_fallback=False, llama=False, model_type="unigram", user_symbols=("@@",)),
    # the same Llama model with transformers' tokenizer.json beside it
    "llama_tokenizer_json": lambda d: kinds.write_llama_tokenizer_json(
        kinds.write_sentencepiece(d, user_symbols=("<tool>",)), legacy=False),
    "llama_tokenizer_json_legacy": lambda d: kinds.write_llama_tokenizer_json(
        kinds.write_sentencepiece(d, user_symbols=("<tool>",)), legacy=True),
    # as Llama-2's published tokenizer.json: Prepend + Replace normalizer, no pre-tokenizer
    "llama2_normalizer_tokenizer_json": lambda d: kinds.write_llama2_normalizer_json(
        kinds.write_sentencepiece(d, user_symbols=("<tool>",))),
    "byte_level_bpe": kinds.write_byte_level,
}
SAMPLES = ["(", " x", "x", "  indented", "def f(a, b):\n    return a", "café 東京", "\n\n"]
REGEX = r"[a-z]{3,8}\([a-z, ]{0,12}\)"
CHOICES = ["red", "green", "blue", "dark red"]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}


class Reference:
    """The tokenizer library's own view of a model directory (not jetserve's)."""

    def __init__(self, d):
        if (d / "tokenizer.json").exists():
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
            self.decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
            self.encode = lambda s: tok.encode(s, add_special_tokens=False).ids
            added = tok.get_added_tokens_decoder()
            self.special = {i for i, t in added.items() if t.special}
            self.added_text = {i: t.content for i, t in added.items() if not t.special}
            self.size = tok.get_vocab_size(with_added_tokens=True)
        else:
            sp = spm.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
            self.decode, self.encode = sp.DecodeIds, sp.EncodeAsIds
            self.size = sp.GetPieceSize()
            self.special = {i for i in range(self.size) if sp.IsControl(i) or sp.IsUnknown(i)}
            proto = pb.ModelProto.FromString(sp.serialized_model_proto())
            self.added_text = {i: p.piece for i, p in enumerate(proto.pieces)
                               if p.type == pb.ModelProto.SentencePiece.USER_DEFINED}

    def added(self, context: list[int], ids: list[int]) -> str:
        """The text `ids` add after `context`."""
        before, after = self.decode(context), self.decode(context + ids)
        assert after.startswith(before), (before, after)
        return after[len(before):]


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request, tmp_path_factory):
    d = KINDS[request.param](tmp_path_factory.mktemp(request.param))
    tok = load_tokenizer(str(d))
    return request.param, Reference(d), tok, ll_tokenizer(tok, tok.vocab_size)


def _frame(b: bytes) -> tuple[bytes, bytes] | None:
    """Bytes before and after `b` that make it whole UTF-8, or None when none can."""
    pre = {0: b"", 1: b"\xc2", 2: b"\xe1", 3: b"\xf1"}.get(
        len(b) - len(b.lstrip(bytes(range(0x80, 0xC0)))))  # by its continuation bytes
    for post in (b"", b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xa0\x80", b"\x90\x80\x80"):
        if pre is not None and _utf8(pre + b + post):
            return pre, post
    return None


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_every_id_stands_for_the_bytes_its_decoding_adds(kind):
    name, ref, tok, lt = kind
    assert lt.vocab_size == ref.size == tok.vocab_size
    context = ref.encode(CONTEXT)
    given = {i: lt.decode_bytes([i]) for i in range(ref.size)}
    byte_id = {b[0]: i for i, b in given.items() if len(b) == 1 and i not in ref.special}
    checked = framed = 0
    for i, b in given.items():
        if i in ref.added_text:  # test_added_tokens_stand_for_their_text
            continue
        if lt.is_special_token(i):  # control, unknown: no text a grammar may take
            # and the 0xFF byte (llguidance's special marker; no UTF-8 text has it)
            assert i in ref.special or ref.added(context, [i]) == "\ufffd", (name, i, b)
            continue
        assert i not in ref.special, (name, i, b)
        if _utf8(b):
            assert ref.added(context, [i]).encode() == b, (name, i, tok.id_to_piece(i), b)
        elif (frame := _frame(b)) is not None:  # a part of a character: complete it
            pre, post = ([byte_id[x] for x in part] for part in frame)
            assert ref.added(context, pre + [i] + post).encode() == frame[0] + b + frame[1], (
                name, i, tok.id_to_piece(i), b)
            framed += 1
        else:  # no character has these bytes (0xFF, ...): both read as replacement
            assert ref.added(context, [i]) == b.decode("utf-8", "replace"), (name, i, b)
        checked += 1
    assert checked >= ref.size - len(ref.special) - len(ref.added_text) - 1
    if name != "sentencepiece_plain":  # byte pieces (fallback, or byte-level BPE)
        assert framed >= 64


def test_added_tokens_stand_for_their_text(kind):
    """An added token that is not special (sentencepiece's user symbols, tokenizer.json's
    non-special added tokens: Qwen's <tool_call>) is its text, which a grammar may take
    (llguidance's own tokenizer.json reader takes every added <...> token as special)."""
    name, ref, tok, lt = kind
    assert ref.added_text, name
    context = ref.encode(CONTEXT)
    for i, text in ref.added_text.items():
        assert ref.added(context, [i]) == text, (name, i)
        assert not lt.is_special_token(i) and lt.decode_bytes([i]) == text.encode(), (name, i)


def test_ids_past_the_tokenizer_stand_for_nothing(kind):
    _, ref, tok, _ = kind
    lt = ll_tokenizer(tok, tok.vocab_size + 24)
    assert lt.vocab_size >= tok.vocab_size + 24
    assert all(lt.is_special_token(i) for i in range(tok.vocab_size, tok.vocab_size + 24))


@pytest.mark.parametrize("text", SAMPLES)
def test_text_llguidance_tokenizes_spells_the_text(kind, text):
    name, ref, tok, lt = kind
    if ref.decode(ref.encode(text)) != text:
        pytest.skip("the tokenizer itself cannot spell this text (its normalizer folds it)")
    ids = lt.tokenize_bytes(text.encode())
    assert b"".join(lt.decode_bytes([i]) for i in ids) == text.encode(), (
        name, [tok.id_to_piece(i) for i in ids])


def _walk(c: Constraint, tok, rng: random.Random, max_steps: int = 80) -> str:
    """One answer a model with uniformly random logits gives under the grammar."""
    g = compile_constraint(c, tok, tok.vocab_size)
    out: list[int] = []
    for _ in range(max_steps):
        bits = np.unpackbits(g.mask_row()[0].view(np.uint8), bitorder="little")
        t = int(rng.choice(np.flatnonzero(bits[: tok.vocab_size])))
        if t in tok.eos_ids:
            break
        assert g.advance(t), (c.kind, [tok.id_to_piece(i) for i in out + [t]])
        out.append(t)
    else:
        raise AssertionError(f"{c.kind}: no end in {max_steps} tokens")
    return tok.decode(out)


@pytest.mark.parametrize("constraint, ok", [
    (Constraint(kind="regex", value=REGEX), lambda s: re.fullmatch(REGEX, s)),
    (Constraint(kind="choice", value=CHOICES), lambda s: s in CHOICES),
    (Constraint(kind="json_schema", value=SCHEMA),
     lambda s: jsonschema.validate(json.loads(s), SCHEMA) is None),
], ids=["regex", "choice", "json_schema"])
def test_random_walks_under_a_grammar_match(kind, constraint, ok):
    name, _, tok, _ = kind
    rng = random.Random(0)
    answers = [_walk(constraint, tok, rng) for _ in range(20)]
    assert [a for a in answers if not ok(a)] == [], name

"""Incremental detokenization and stop strings, on the three kinds of tokenizer.

The sentencepiece (byte fallback) and byte-level BPE tokenizers are trained here on a
small text in well under a second, then loaded through jetserve.tokenizer.
"""

import functools
import io
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.mock_engine import ByteTokenizer
from jetserve.orchestrator.detokenize import (
    REPLACEMENT,
    IncrementalDetokenizer,
    StopStrings,
    TextStream,
    make_detokenizer,
)
from jetserve.tokenizer import HFTokenizer, SentencePieceTokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a test of the tokenizer and its pieces.",
    "東京は日本の首都です。中文字符和日本語の文字。",
    "emoji 😀 are fun 🎉🎉 and 👩‍🚀 too",
    "naïve café déjà vu — “quotes” ½",
    "def f(x):\n    return x * 2\n",
] * 40

_TMP = tempfile.mkdtemp(prefix="jetserve-detok-")


@functools.cache
def sentencepiece_tokenizer() -> SentencePieceTokenizer:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=420, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", character_coverage=0.9995,
        minloglevel=2,
    )
    path = os.path.join(_TMP, "sp.model")
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return SentencePieceTokenizer(path)


@functools.cache
def byte_bpe_tokenizer() -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path = os.path.join(_TMP, "tokenizer.json")
    tok.save(path)
    return HFTokenizer(path)


TOKENIZERS = {
    "sentencepiece": sentencepiece_tokenizer,
    "byte_bpe": byte_bpe_tokenizer,
    "bytes": lambda: ByteTokenizer(),
}

# Random Unicode leaning on what splits across tokens: CJK, emoji, ZWJ sequences, accents.
unicode_text = st.lists(
    st.one_of(
        st.characters(min_codepoint=0x20, max_codepoint=0x7E),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
        st.sampled_from(["\u200d", "é", "ñ", " ", "  ", "\n", "\ufffd", "👩‍🚀", "中文"]),
        st.characters(exclude_categories=("Cs",)),
    ),
    max_size=40,
).map("".join)


def stream(tok, ids, context=()):
    d = make_detokenizer(tok, context)
    chunks = [d.push(t) for t in ids]
    chunks.append(d.flush())
    return chunks


# ---- properties -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=unicode_text)
def test_stream_equals_decode_and_never_splits_a_character(kind, text):
    tok = TOKENIZERS[kind]()
    ids = tok.encode(text, add_bos=False)
    chunks = stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(chunks) == full
    if REPLACEMENT not in full:
        assert not any(REPLACEMENT in c for c in chunks), chunks


@pytest.mark.parametrize("kind", list(TOKENIZERS))
@settings(max_examples=100, deadline=None)
@given(text=unicode_text, data=st.data())
def test_prompt_context_keeps_the_continuation_exact(kind, text, data):
    """prompt text + streamed text == decode(prompt + generated) (leading spaces kept)."""
    tok = TOKENIZERS[kind]()
    ids = tok.encode(text, add_bos=False)
    k = data.draw(st.integers(0, len(ids)))
    prompt_text, full = tok.decode(ids[:k]), tok.decode(ids)
    if not full.startswith(prompt_text) or prompt_text.endswith(REPLACEMENT):
        return  # the prompt ends inside a character: no exact split exists
    assert prompt_text + "".join(stream(tok, ids[k:], ids[:k])) == full


@pytest.mark.parametrize("kind", ["sentencepiece", "byte_bpe"])
@settings(max_examples=100, deadline=None)
@given(text=unicode_text.filter(lambda s: len(s) >= 2), data=st.data())
def test_stop_string_spanning_tokens_is_cut_and_never_emitted(kind, text, data):
    tok = TOKENIZERS[kind]()
    ids = tok.encode(text, add_bos=False)
    full = tok.decode(ids)
    if len(full) < 2:
        return
    i = data.draw(st.integers(0, len(full) - 1))
    j = data.draw(st.integers(i + 1, min(len(full), i + 6)))
    stop = full[i:j]
    ts = TextStream(tok, (), [stop])
    out, hit = [], None
    for t in ids:
        text_out, hit = ts.push(t)
        out.append(text_out)
        assert stop not in "".join(out)
        if hit is not None:
            break
    if hit is None:
        out.append(ts.finish())
    else:
        assert hit == stop
    assert "".join(out) == full[: full.find(stop)]


# ---- examples ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [make_detokenizer, IncrementalDetokenizer])
def test_byte_tokens_of_an_emoji_wait_for_the_last_byte(make):
    tok = ByteTokenizer()
    d = make(tok)
    chunks = [d.push(t) for t in "a😀b".encode()] + [d.flush()]
    assert chunks == ["a", "", "", "", "😀", "b", ""]


@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=30))
def test_byte_shortcut_equals_the_window_method_on_any_bytes(data):
    tok = ByteTokenizer()
    fast, slow = make_detokenizer(tok), IncrementalDetokenizer(tok)
    a = [fast.push(b) for b in data] + [fast.flush()]
    b = [slow.push(b) for b in data] + [slow.flush()]
    assert "".join(a) == "".join(b) == tok.decode(list(data))


def test_sentencepiece_continuation_keeps_its_leading_space():
    tok = sentencepiece_tokenizer()
    prompt = tok.encode("Hello world,", add_bos=True)
    gen = tok.encode("Hello world, this is", add_bos=False)[len(prompt) - 1:]
    assert "".join(stream(tok, gen, prompt)) == " this is"
    # Without context the first piece's space is dropped, as decode(gen) does.
    assert "".join(stream(tok, gen)) == tok.decode(gen) == "this is"


def test_flush_emits_a_character_left_incomplete_as_decode_does():
    tok = ByteTokenizer()
    ids = list("x中".encode())[:-1]
    chunks = stream(tok, ids)
    assert chunks[:-1] == ["x", "", ""] and chunks[-1] == REPLACEMENT == tok.decode(ids)[1:]


def test_stop_strings_hold_back_possible_prefixes():
    s = StopStrings(["END", "xyz"])
    assert s.feed("abc E") == ("abc ", None)
    assert s.feed("N") == ("", None)
    assert s.feed("Dafter") == ("", "END")


def test_stop_strings_release_a_false_start_and_pick_the_earliest():
    s = StopStrings(["END", "D!"])
    assert s.feed("EN") == ("", None)
    assert s.feed("x") == ("ENx", None)
    assert s.feed("1 END!") == ("1 ", "END")  # END starts before D!
    s = StopStrings(["abc"])
    assert s.feed("ab") == ("", None)
    assert s.flush() == "ab"


def test_text_stream_finish_flushes_held_text():
    ts = TextStream(ByteTokenizer(), (), ["STOP"])
    out = [ts.push(t)[0] for t in b"go ST"]
    assert "".join(out) == "go " and ts.finish() == "ST"

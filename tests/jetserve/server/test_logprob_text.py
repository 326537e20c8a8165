"""Log-prob entries show decoded text that joins to the output, exact bytes, and labels
that never merge two ids: on the bundled sentencepiece model (byte fallback) and on a
byte-level BPE tokenizer."""

import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.orchestrator.detokenize import completion_text
from jetserve.server.logprob_text import TokenTexts, token_bytes
from jetserve.tokenizer import load_tokenizer
from tests.jetserve.test_tokenizer import write_byte_level_bpe

# Characters the bundled model has no piece for come out as byte-fallback pieces.
TEXTS = ["def f(x):\n    return x  # 東京 🙂 é\n", "😀😀 ½\t\n        pass", "    # S"]


@pytest.fixture(scope="module")
def sp():
    return load_tokenizer(BUNDLED_DIR)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    d = write_byte_level_bpe(tmp_path_factory.mktemp("bpe"), [t * 5 for t in TEXTS], 320)
    return load_tokenizer(str(d))


@pytest.mark.parametrize("name", ["sp", "bpe"])
def test_texts_join_to_the_decoded_text_and_bytes_to_its_utf8(name, request):
    tok = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tok.encode(text)  # BOS first: it shows no text and no bytes
        shown = [s for s, _ in TokenTexts(tok).feed(ids, None, final=True)]
        assert "".join(s.text for s in shown) == text
        assert b"".join(s.data for s in shown) == text.encode("utf-8")
        assert shown[0].text == "" and shown[0].data == b""
        for i, s in zip(ids, shown, strict=True):
            own = token_bytes(tok, i)
            if own is not None and i != tok.bos_id:
                assert s.data == own  # every token's own bytes, split characters too
    # The example: the pieces "▁▁▁▁", "#", "▁S" show as text.
    if name == "sp":
        shown = TokenTexts(tok).feed(tok.encode("    # S", add_bos=False), None, final=True)
        assert [s.text for s, _ in shown] == ["    ", "#", " S"]


def test_split_characters_come_out_where_they_complete(sp):
    ids = sp.encode("a🙂", add_bos=False)
    assert [sp.id_to_piece(i) for i in ids] == ["a", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    shown = [s for s, _ in TokenTexts(sp).feed(ids, None, final=True)]
    assert [s.text for s in shown] == ["a", "", "", "", "🙂"]
    assert [s.data for s in shown] == [b"a", b"\xf0", b"\x9f", b"\x99", b"\x82"]
    # Cut short, the held bytes come out as U+FFFD at the end, as the streamed text does.
    shown = [s for s, _ in TokenTexts(sp).feed(ids[:3], None, final=True)]
    assert "".join(s.text for s in shown) == sp.decode(ids[:3]) == "a\ufffd\ufffd"
    assert b"".join(s.data for s in shown) == b"a\xf0\x9f"


@pytest.mark.parametrize("name", ["sp", "bpe"])
def test_streamed_in_pieces_equals_at_once_and_matches_the_streamed_text(name, request):
    tok = request.getfixturevalue(name)
    prompt = tok.encode("x = 1\n")
    ids = tok.encode(TEXTS[0] + TEXTS[1], add_bos=False)
    whole = TokenTexts(tok, prompt).feed(ids, None, final=True)
    stream, parts = TokenTexts(tok, prompt), []
    for a in range(0, len(ids), 3):
        parts += stream.feed(ids[a:a + 3], None, final=a + 3 >= len(ids))
    assert parts == whole
    assert "".join(s.text for s, _ in whole) == completion_text(tok, prompt, ids, False)


def test_alternatives_that_decode_alike_keep_distinct_labels(sp):
    """Ids 4 ("    ", never emitted) and 262 ("▁▁▁▁") decode alike, and all byte pieces
    decode to U+FFFD alone: each keeps its own label and its own log-prob."""
    byte_ids = [sp.token_to_id(f"<0x{b:02X}>") for b in (0xF0, 0x9F, 0xE6)]
    alts = [(262, -0.5), (4, -1.0), *[(b, -2.0 - k) for k, b in enumerate(byte_ids)]]
    ctx = sp.encode("def f():\n")
    ((sampled, shown),) = TokenTexts(sp, ctx).feed([262], [alts], final=False)
    labels = [a.label for a, _ in shown]
    assert len(set(labels)) == len(alts)
    assert labels[0] == sampled.label == "    " and sampled.text == "    "
    assert labels[1] == "token_id:4"  # its piece, "    ", is taken too
    assert labels[2:] == ["bytes:\\xf0", "bytes:\\x9f", "bytes:\\xe6"]
    assert [a.data for a, _ in shown] == [b"    ", b"    ", b"\xf0", b"\x9f", b"\xe6"]
    assert [lp for _, lp in shown] == [lp for _, lp in alts]


def test_token_ids_mode_and_no_tokenizer(sp):
    for texts in (TokenTexts(sp, as_token_ids=True), TokenTexts(None)):
        shown = texts.feed([262, 3], [[(262, -0.1), (3, -2.0)], []], final=True)
        assert [s.text for s, _ in shown] == ["token_id:262", "token_id:3"]
        assert [a.label for a, _ in shown[0][1]] == ["token_id:262", "token_id:3"]

"""The bundled model's tokenizer through transformers gives the ids it was trained on.

The model learned sentencepiece's tokenization (scripts/train_bundled_model.py encodes
the corpus with `SentencePieceProcessor`), which jetserve's tokenizer is. Clients that
tokenize on their side (lm-eval, vLLM, GuideLLM) load it with `AutoTokenizer`; the two
must agree id for id, whitespace runs included, or those clients score another model.
"""

from __future__ import annotations

import os
import shutil

import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.tokenizer import load_tokenizer
from tests.jetserve.test_bundled_model import _training_script

README_PROMPT = "def add(a, b):\n    "
# Runs of spaces, tabs and newlines in every order, the places where the tokenizers
# could split differently (user symbols, "▁" runs, byte fallback).
WHITESPACE = ([" " * n + "x" for n in range(1, 18)]
              + ["\n" + " " * n + "pass\n" for n in (3, 4, 5, 8, 9, 12)]
              + ["    ", "        ", "\t    \t", "  \n    \n\n\t", "x    ", "a\u00a0b",
                 "\r\n    return 1\r\n", "    # 東京 🙂 é\n        ", README_PROMPT])

SPECIALS_IN_TEXT = ["<s>", "</s>", "x</s>\n    y", "a <s> b</s>c<unk>", "<s><s>  </s>", "<s"]


@pytest.fixture(scope="module")
def ours():
    return load_tokenizer(BUNDLED_DIR)


@pytest.fixture(scope="module")
def heldout_texts() -> list[str]:
    """The stdlib files the model never saw (the training script's own split)."""
    script = _training_script()
    root, rels = script.stdlib_files()
    texts = []
    for rel in rels:
        if script.is_heldout(rel):
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    assert len(texts) >= 10
    return texts


@pytest.mark.parametrize("use_fast", [True, False])
def test_transformers_encodes_as_jetserve(ours, heldout_texts, use_fast):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(BUNDLED_DIR, use_fast=use_fast)
    n_tokens = 0
    for text in WHITESPACE + heldout_texts:
        ids = ours.encode(text)  # BOS added by both (add_bos_token is true)
        assert ref(text)["input_ids"] == ids, repr(text[:80])
        assert ref.decode(ids, skip_special_tokens=True) == ours.decode(ids) == text
        n_tokens += len(ids)
    assert n_tokens > 100_000  # the whole held-out corpus, not a sample of it
    # Special pieces written in the text are their ids on both sides (decoding drops them).
    for text in SPECIALS_IN_TEXT:
        assert ref(text)["input_ids"] == ours.encode(text), repr(text)
        assert ref(text, add_special_tokens=False)["input_ids"] == ours.encode(text, add_bos=False)
    # A 4-space indent is the piece the model was trained on, "▁▁▁▁", not the user
    # symbol "    " sentencepiece never emits.
    indent = ref.encode("    ", add_special_tokens=False)
    assert indent == ours.encode("    ", add_bos=False)
    assert [ours.id_to_piece(i) for i in indent] == ["▁▁▁▁"]


def test_training_script_writes_the_shipped_tokenizer(tmp_path, heldout_texts):
    """The script's fix-up of a freshly trained tokenizer gives the shipped file, and
    changes nothing sentencepiece emits."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    shipped = os.path.join(BUNDLED_DIR, "tokenizer.model")
    proto = pb.ModelProto()
    with open(shipped, "rb") as f:
        proto.ParseFromString(f.read())
    retired = [p for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.UNUSED]
    assert [p.piece for p in retired] == ["    "]
    retired[0].type = pb.ModelProto.SentencePiece.USER_DEFINED  # as the trainer writes it
    trained = tmp_path / "trained.model"
    trained.write_bytes(proto.SerializeToString())
    fixed = shutil.copy(trained, tmp_path / "fixed.model")
    _training_script().retire_unreachable_symbols(str(fixed))
    with open(shipped, "rb") as f:
        assert (tmp_path / "fixed.model").read_bytes() == f.read()
    texts = WHITESPACE + heldout_texts[:5]
    as_trained = spm.SentencePieceProcessor(model_file=str(trained)).encode(texts)
    assert as_trained == spm.SentencePieceProcessor(model_file=shipped).encode(texts)

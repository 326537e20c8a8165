"""Tokenizers from model directories, checked against transformers' tokenizers on the same
files: sentencepiece `tokenizer.model` and byte-level BPE `tokenizer.json`."""

import json

import pytest
import sentencepiece as spm

from jetserve.tokenizer import HFTokenizer, SentencePieceTokenizer, load_tokenizer

TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20
        + "naïve café — 東京 🙂\n")
SAMPLES = ["def f(x):\n    return x * 2", "  indented\ttabs", "東京 🙂 café", "a" * 30]


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    (d / "corpus.txt").write_text(TEXT)
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "tokenizer"), vocab_size=330,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
        remove_extra_whitespaces=False, normalization_rule_name="identity")
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    return d


def write_byte_level_bpe(d, texts: list[str], vocab_size: int,
                         specials: tuple[str, ...] = ("<|bos|>", "<|eos|>")):
    """A byte-level BPE `tokenizer.json` (GPT-2 / Llama 3 style) trained on `texts`, with
    `specials` first (<|bos|> and <|eos|> among them), in directory `d`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>", "add_bos_token": True}))
    return d


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    return write_byte_level_bpe(tmp_path_factory.mktemp("bpe"), [TEXT], 400)


def test_sentencepiece_round_trips_with_byte_fallback(sp_dir):
    ours = load_tokenizer(str(sp_dir))
    assert isinstance(ours, SentencePieceTokenizer)
    assert ours.bos_id == 1 and ours.eos_ids == (2,)
    assert ours.chat_template.startswith("{% for m")
    for s in SAMPLES:
        ids = ours.encode(s, add_bos=False)
        assert ours.decode(ids) == s  # byte fallback: nothing lost, CJK and emoji included
        assert ours.encode(s) == [1] + ids
    # characters outside the learned pieces come out as byte pieces
    assert any(ours.id_to_piece(i).startswith("<0x") for i in ours.encode("Ω😀", add_bos=False))
    assert ours.decode(ours.encode("Ω😀", add_bos=False)) == "Ω😀"


def test_tokenizer_json_matches_transformers(bpe_dir):
    from transformers import PreTrainedTokenizerFast

    ours = load_tokenizer(str(bpe_dir))
    assert isinstance(ours, HFTokenizer)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))
    assert ours.bos_id == ref.convert_tokens_to_ids("<|bos|>")
    assert ours.eos_ids == (ref.convert_tokens_to_ids("<|eos|>"),)
    for s in SAMPLES:
        ids = ours.encode(s, add_bos=False)
        assert ids == ref.encode(s, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids) == s
        assert ours.encode(s)[0] == ours.bos_id


def test_no_tokenizer_and_bad_files(tmp_path):
    assert load_tokenizer(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))

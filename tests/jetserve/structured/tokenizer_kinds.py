"""Model-directory tokenizers of every kind the loader accepts, trained here on a few
files of the Python standard library (on every machine) so a test needs no download:
sentencepiece with and without byte fallback and a dummy prefix, the same model with
transformers' Llama `tokenizer.json` beside it, and a byte-level BPE `tokenizer.json`."""

from __future__ import annotations

import json
import os
import sysconfig

import sentencepiece as spm

from tests.jetserve.test_tokenizer import write_byte_level_bpe

VOCAB = 1000
# Text the stdlib does not have much of, so the vocabulary has multi-byte characters
# and byte pieces are used.
EXTRA = "naïve café — 東京タワー 🙂 Grüße, Ωμέγα; ¿qué? «ok»\n" * 20
LLAMA_CONFIG = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True}


def stdlib_texts(count: int = 40) -> list[str]:
    """The first `count` top-level modules of this Python's stdlib, and EXTRA."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py"))[:count]
    texts = []
    for n in names:
        with open(os.path.join(root, n), encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return texts + [EXTRA]


def _chunks(texts: list[str], size: int = 4000):
    for t in texts:
        for i in range(0, len(t), size):
            yield t[i:i + size]


def write_sentencepiece(d, *, byte_fallback: bool = True, model_type: str = "bpe",
                        llama: bool = True, user_symbols: tuple[str, ...] = ()):
    """`tokenizer.model` + a LlamaTokenizer `tokenizer_config.json` in `d`. llama=True:
    Llama 2's settings (byte fallback, identity normalizer, dummy "▁" prefix, digits
    split); False: sentencepiece's defaults (NFKC, whitespace folded, dummy prefix)."""
    opts = dict(normalization_rule_name="identity", remove_extra_whitespaces=False,
                split_digits=True, allow_whitespace_only_pieces=True) if llama else {}
    spm.SentencePieceTrainer.train(
        sentence_iterator=_chunks(stdlib_texts()), model_prefix=str(d / "tokenizer"),
        model_type=model_type, vocab_size=VOCAB, byte_fallback=byte_fallback,
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        user_defined_symbols=list(user_symbols), max_sentence_length=16384,
        num_threads=1, minloglevel=2, **opts)
    os.remove(d / "tokenizer.vocab")
    (d / "tokenizer_config.json").write_text(json.dumps(LLAMA_CONFIG))
    return d


def write_llama_tokenizer_json(d, *, legacy: bool):
    """transformers' own conversion of `d`'s tokenizer.model, written beside it as the
    Llama-2 style `tokenizer.json` (Metaspace "▁", ByteFallback decoder)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(d), legacy=legacy)
    tok.backend_tokenizer.save(str(d / "tokenizer.json"))
    return d


def write_llama2_normalizer_json(d):
    """transformers' conversion with the older layout Llama-2 checkpoints publish: the
    "▁" prefix and spaces made by the normalizer (Prepend, Replace), no pre-tokenizer."""
    write_llama_tokenizer_json(d, legacy=True)
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    spec["pre_tokenizer"] = None
    (d / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return d


def write_byte_level(d, added: tuple[str, ...] = ("<tool_call>",)):
    """A byte-level BPE (GPT-2 / Llama 3 style) with special <|bos|> <|eos|> <|pad|> and
    the non-special added tokens `added`."""
    from tokenizers import AddedToken, Tokenizer

    write_byte_level_bpe(d, stdlib_texts(), VOCAB, ("<|bos|>", "<|eos|>", "<|pad|>"))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in added])
    tok.save(str(d / "tokenizer.json"))
    return d

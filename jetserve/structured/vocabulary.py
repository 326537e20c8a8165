"""The served model's vocabulary as llguidance sees it: one `LLTokenizer` per tokenizer.

llguidance computes a token mask by walking every token's bytes through the grammar, so
it needs the bytes each id stands for. A `tokenizer.json` (HF tokenizers, byte-level BPE
or not) is handed over whole: llguidance reads it natively. A sentencepiece model is
described token by token from `token_bytes` (jetserve/tokenizer.py); control and unknown
pieces, which stand for no text, are marked special (a 0xFF byte first, llguidance's
convention) so no grammar ever allows them. Ids past the tokenizer's vocabulary (models
pad their embedding) stand for nothing and are never allowed either.

Building one walks the whole vocabulary (up to about a second for 128k tokens), so it is
built once per tokenizer and model vocabulary size and kept.
"""

from __future__ import annotations

import threading
import weakref

import llguidance

_SPECIAL = b"\xff"
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance tokenizer of `tokenizer` over a model vocabulary of `vocab_size`
    ids (cached per tokenizer object)."""
    with _lock:
        per = _cache.setdefault(tokenizer, {})
        if vocab_size not in per:
            per[vocab_size] = _build(tokenizer, vocab_size)
        return per[vocab_size]


def _build(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    eos = list(tokenizer.eos_ids)
    if not eos:
        raise ValueError("structured output needs the tokenizer's EOS id (where a grammar "
                         "may end); this tokenizer has none")
    hf = getattr(tokenizer, "tok", None)
    if hf is not None:  # HF tokenizers: llguidance reads tokenizer.json itself
        n = max(vocab_size, tokenizer.vocab_size)
        return llguidance.LLTokenizer(hf.to_str(), n_vocab=n, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Pieces(tokenizer, vocab_size)))


class _Pieces:
    """A sentencepiece tokenizer in the shape llguidance.TokenizerWrapper reads."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        tokens: list[bytes] = []
        special: list[int] = []
        for i in range(max(vocab_size, tokenizer.vocab_size)):
            b = tokenizer.token_bytes(i) if i < tokenizer.vocab_size else None
            if b is None:
                piece = tokenizer.id_to_piece(i) if i < tokenizer.vocab_size else f"<pad{i}>"
                b = _SPECIAL + piece.encode("utf-8")
                special.append(i)
            tokens.append(b)
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):  # llguidance probes with bytes; we take text only
            raise TypeError("text, not bytes")
        # llguidance reads these ids as exactly `text` (the bytes it forces, which it
        # tokenizes to allow); `encode` would start them with a space (the dummy prefix)
        return self._tok.encode_verbatim(text)

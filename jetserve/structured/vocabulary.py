"""The served model's vocabulary as llguidance sees it: one `LLTokenizer` per tokenizer.

llguidance computes a token mask by walking every token's bytes through the grammar, so
it needs the bytes each id adds to a text, and a tokenize function whose ids spell a
text exactly (it re-tokenizes the bytes a grammar forces). Every tokenizer is described
token by token from `token_bytes` and tokenized with `encode_verbatim`
(jetserve/tokenizer.py): sentencepiece without its dummy-prefix space or normalizer,
tokenizer.json without its Prepend / Metaspace prefix. (llguidance's own tokenizer.json
reader would take every added `<...>` token as special, so a grammar could never use
Qwen's `<tool_call>` token.) Special tokens, control and unknown pieces, which stand for
no text, are marked special (a 0xFF byte first, llguidance's convention) so no grammar
ever allows them. Ids past the tokenizer's vocabulary (models pad their embedding) stand
for nothing and are never allowed either.

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
    pieces = _Pieces(tokenizer, vocab_size)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(pieces),
                                  n_vocab=len(pieces.tokens), eos_token=eos)


class _Pieces:
    """A tokenizer in the shape llguidance.TokenizerWrapper reads."""

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
        unread = sum(1 for i in special if i < tokenizer.vocab_size)
        if unread > tokenizer.vocab_size // 2:
            raise ValueError(
                "structured output needs the bytes each token stands for; this tokenizer's "
                f"pieces do not say for {unread} of {tokenizer.vocab_size} ids (its decoder "
                "is not byte-level, byte-fallback or Metaspace)")
        self.tokens = tokens
        self.special_token_ids = special

    def __call__(self, text: str) -> list[int]:
        if isinstance(text, bytes):  # llguidance probes with bytes; we take text only
            raise TypeError("text, not bytes")
        # llguidance reads these ids as exactly `text` (the bytes it forces, which it
        # tokenizes to allow); `encode` would start them with a space (the dummy prefix)
        return self._tok.encode_verbatim(text)

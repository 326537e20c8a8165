"""The strings log-prob entries show for token ids: decoded text, exact bytes, labels.

OpenAI and vLLM show each sampled token as the text it adds, so the `tokens` of a
completion (and the `token`s of chat `content`) join to the choice's text. A token that
holds only part of a character (byte-fallback pieces, byte-level BPE fragments) adds
nothing until the token that completes the character, which carries all of it;
`bytes` stays each token's own exact bytes, so the bytes also join to the text's UTF-8.
The texts come from the orchestrator's own incremental detokenizer, seeded with the same
prompt tail, so they are the streamed text token by token.

Alternatives in `top_logprobs` are labelled by their text decoded after the tokens
sampled before them (a sentencepiece piece keeps its leading space). Two distinct ids
never share a label, as a completion's `top_logprobs` is a dict keyed by it: a fragment
is labelled `bytes:\\xNN` (OpenAI's form), and a label already taken at that position
falls back to the vocabulary piece, then to vLLM's `token_id:N`. With vLLM's
`return_tokens_as_token_ids`, or a model without a tokenizer (no text to join to), every
token shows as `token_id:N`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jetserve.orchestrator.detokenize import CONTEXT_TOKENS, REPLACEMENT, make_detokenizer


@dataclasses.dataclass(frozen=True)
class Shown:
    """One token as an entry shows it."""

    text: str  # what it adds to the text ("" while a character is incomplete)
    data: bytes  # its own bytes
    label: str  # its name among a position's top_logprobs


def token_bytes(tokenizer: Any, i: int) -> bytes | None:
    """The exact bytes token `i` stands for, or None where only its text says."""
    if hasattr(tokenizer, "id_to_bytes"):
        return tokenizer.id_to_bytes(int(i))
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(int(i))
    return None


def _fragment_label(data: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenTexts:
    """One sequence's tokens as entries show them, fed in order (a stream feeds each
    delta; the state carries a split character over to the next delta)."""

    def __init__(self, tokenizer: Any, context_ids: Sequence[int] = (),
                 as_token_ids: bool = False):
        self._tok = None if as_token_ids else tokenizer
        self._detok = make_detokenizer(tokenizer, context_ids) if self._tok is not None else None
        self._recent = [int(i) for i in context_ids][-CONTEXT_TOKENS:]
        self._held = b""  # bytes of tokens whose text has not come out yet

    def feed(self, ids: Sequence[int], tops: Sequence[Sequence[tuple[int, float]]] | None,
             *, final: bool) -> list[tuple[Shown, list[tuple[Shown, float]]]]:
        """Each token of `ids` with its top alternatives (`tops[k]`, (id, logprob) pairs);
        `final`: the sequence ends here, so a split character comes out as U+FFFD."""
        out = []
        for k, t in enumerate(int(i) for i in ids):
            alts = list(tops[k]) if tops is not None and k < len(tops) else []
            alt_ids = [int(a) for a, _ in alts]
            # The sampled token is labelled with its alternatives, so no alternative that
            # decodes alike takes its label (completions put it in the same dict).
            shown = self._alternatives(alt_ids + ([] if t in alt_ids else [t]))
            label = shown[alt_ids.index(t) if t in alt_ids else -1].label
            sampled = self._sampled(t, label, last=final and k == len(ids) - 1)
            out.append((sampled, [(a, float(lp)) for a, (_, lp) in zip(shown, alts, strict=False)]))
            self._recent = (self._recent + [t])[-CONTEXT_TOKENS:]
        return out

    def _sampled(self, t: int, label: str, *, last: bool) -> Shown:
        if self._detok is None:
            return Shown(text=label, data=label.encode(), label=label)
        text = self._detok.push(t) + (self._detok.flush() if last else "")
        own = token_bytes(self._tok, t)
        if not text:  # mid-character (or a special token, which has no bytes of text)
            self._held += own or b""
            return Shown(text="", data=own or b"", label=label)
        whole = text.encode("utf-8")
        if self._held and whole.startswith(self._held):
            data = whole[len(self._held):]
        else:
            data = own if self._held and own is not None else whole
        self._held = b""
        return Shown(text=text, data=data, label=label)

    def _alternatives(self, ids: list[int]) -> list[Shown]:
        if self._tok is None:
            return [Shown(text=f"token_id:{i}", data=f"token_id:{i}".encode(),
                          label=f"token_id:{i}") for i in ids]
        decode = self._tok.decode
        base = decode(self._recent) if self._recent else ""
        taken: set[str] = set()
        out = []
        for i in ids:
            full = decode(self._recent + [i])
            text = full[len(base):] if full.startswith(base) else decode([i])
            own = token_bytes(self._tok, i)
            data = own if own is not None else text.encode("utf-8")
            label = text
            if REPLACEMENT in text and own:
                label = _fragment_label(own)
            for candidate in (label, self._piece(i), f"token_id:{i}"):
                if candidate not in taken:
                    label = candidate
                    break
            taken.add(label)
            out.append(Shown(text=text, data=data, label=label))
        return out

    def _piece(self, i: int) -> str:
        piece = getattr(self._tok, "id_to_piece", None)
        return piece(i) if piece is not None else f"token_id:{i}"

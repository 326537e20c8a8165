"""Any constraint within max_tokens: answers steered shut before the budget ends.

A strict JSON schema, a forced tool call, a choice, a regex or a grammar sampled at a
high temperature may write a string, an array or a list of calls that never ends: cut by
max_tokens, the answer does not parse. `GrammarBudget` keeps, for one request, a short
completion of the answer from the grammar's current state and steers the mask onto it
when the budget gets short:

  S  a shortest completion found by a search over the grammar itself (`shortest`): from
     a copy of the llguidance matcher, bytes are tried as single-byte tokens (every byte
     is one in any vocabulary llguidance serves), forced bytes taken at once, the
     matcher says where the answer may end. A uniform-cost search over byte strings,
     kept narrow (a few children per node, bytes that close things first, a few nodes
     per length, no byte that leaves the allowed bytes as they were: more of the same
     string or number), so it costs a few milliseconds at most on a schema; no kind is
     special.
  c  the tokens of S's plan, plus the EOS where the grammar still takes more after S
     (a list of tool calls may go on).
  r  the tokens the request may still generate, this one included.

While |S| + M <= r - 1 (|S| in bytes, EOS included: a byte a token at most) the mask is
left alone, M being the most one token is taken to lengthen S: one more copy of the
smallest answer (a token may open another call or array item, as large as the whole),
plus a few bytes (nothing is steered where S is empty: the answer is whole as it stands,
and what may follow is the grammar's to say, but for the last token, which must keep it
whole). M is a judgement, not a
proof: a grammar where one token commits to much more (a choice of a long and a short
answer) is covered by the check of few tokens below. Past that only the next
token of S's plan is allowed, so the answer closes by S; the plan spells S in the tokens
the grammar's masks allow along it (llguidance may allow only one tokenization of bytes
it forces), c of them. Where a mask allows only a few tokens (a choice, an enum), each is
checked on its own: it stays only if the S after it fits. Where even c > r at admission
the request is refused (`minimum`): a 400 naming max_tokens.

json_object keeps json_budget.py, which tracks the object's text exactly and steers
later; this covers every other kind.
"""

from __future__ import annotations

import heapq
import itertools

import llguidance
import llguidance.numpy
import numpy as np

from jetserve.structured.json_budget import GrowthTable

# Bytes tried first at each node: those that close strings and containers, the shortest
# values, separators, then the start of literals.
_CLOSING_FIRST = b'"}])0,:[{ftn'
_FALLBACKS = 3  # besides those, the first few other bytes the grammar allows
_SCAN = [*range(0x20, 0x7F), *range(0x20), *range(0x7F, 0x100)]  # printable ASCII first
# The walk's order: the closing bytes, then the rest in _SCAN's order. A container's end
# always counts as a step forward (closing a nested object leaves the same bytes allowed);
# a string's end comes before, so `]` and `}` inside a string are never tried.
_ORDER = [*_CLOSING_FIRST, *(b for b in _SCAN if b not in _CLOSING_FIRST)]
_CLOSERS = frozenset(b"]}")
_WIDTH = 8  # nodes kept per length of S
_MAX_BYTES = 512  # a completion longer than this is not searched for
_MAX_NODES = 1000
_MARGIN = 8
_FEW = 16  # a row allowing at most this many tokens has each checked
_WHOLE = 8192  # the last token of a whole answer: checked up to this many


class GrammarBudget:
    """One request's short completion S, the tokens that spell it, and the mask narrowing
    they ask for."""

    def __init__(self, matcher: llguidance.LLMatcher, table: GrowthTable, vocab_size: int,
                 eos_ids: tuple[int, ...]):
        self.matcher = matcher
        self.table = table
        self.vocab_size = vocab_size
        self.eos_ids = tuple(i for i in eos_ids if i < vocab_size)
        self._byte_token = _byte_tokens(table)
        self._scratch = llguidance.numpy.allocate_token_bitmask(1, max(vocab_size,
                                                                       len(table.bytes)))
        self._s: bytes | None = None  # S from the matcher's current state (None: not known)
        self._stale: bytes | None = None  # S before the last token, when it did not spell it
        self._started = False  # a token was taken
        self._end = 0  # 1 when an EOS must follow S
        self._plan: list[int] | None = None  # the tokens spelling S, EOS last when needed
        first = self.minimum()
        # The most one token may lengthen S: another whole smallest answer, and a margin.
        self.margin = (first if first is not None else 0) + _MARGIN

    def minimum(self) -> int | None:
        """The tokens S takes from here (its plan, without a last EOS): at the answer's
        start, the fewest tokens a whole answer takes (of those the search finds); None
        when the search finds none."""
        plan = self._ensure_plan()
        if plan is None:
            return None
        return len(plan) - (1 if plan and plan[-1] in self.eos_ids else 0)

    def take(self, token: int) -> None:
        """After the matcher took `token`: S (and its plan) stay known when the token
        spelt their start."""
        self._started = True
        b = self.table.bytes[token] if 0 <= token < len(self.table.bytes) else b""
        if self._plan and self._plan[0] == token:
            self._plan.pop(0)
        else:
            self._plan = None
        if self._s is not None and b and self._s.startswith(b):
            self._s = self._s[len(b):]
        else:  # S may well still close the answer (a token inside a string): tried first
            self._stale, self._s, self._plan = self._s, None, None

    def narrow(self, row: np.ndarray, remaining: int) -> None:
        """Narrows one packed mask row i32[W] (in place) so that the answer closes in
        `remaining` - 1 tokens after this one. Where the grammar allows only a few tokens
        (a choice, an enum, a list's end), each is checked: its own S must fit. Then the
        row is left as it is while S, a byte a token, fits with the margin to spare (or
        when no completion is known), else only the next token of S's plan is allowed
        (unless the row does not allow it)."""
        self._keep_few(row, remaining - 1)
        if self._ensure_s() == b"" and remaining == 1:
            self._keep_whole(row)
        # S empty: the answer is whole as it stands (a regex or grammar that may go on);
        # it is the grammar's to say what may follow, but for the last token.
        if not self._s or len(self._s) + self._end + self.margin <= remaining - 1:
            return
        plan = self._ensure_plan()
        if not plan:
            return
        word, bit = divmod(plan[0], 32)
        if not (int(row[word]) >> bit) & 1:
            return
        row[:] = 0
        row[word] = np.int32(np.uint32(1 << bit).view(np.int32))

    def _keep_few(self, row: np.ndarray, room: int) -> None:
        """Where the row allows at most _FEW tokens, drops those after which no completion
        of at most `room` bytes is found (all kept when that would drop every one)."""
        V = self.vocab_size
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V])
        if len(allowed) > _FEW or len(allowed) < 2:
            return
        drop = [t for t in allowed if not self._fits_after(int(t), room)]
        if 0 < len(drop) < len(allowed):
            for t in drop:
                word, bit = divmod(int(t), 32)
                row[word] = np.int32(np.uint32(int(row[word]) & ~(1 << bit) & 0xFFFFFFFF)
                                     .view(np.int32))

    def _keep_whole(self, row: np.ndarray) -> None:
        """The last token of a whole answer: only EOS and tokens after which it is still
        whole (checked where the row allows at most _WHOLE tokens; all kept when none)."""
        V = self.vocab_size
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:V].astype(bool)
        allowed = np.flatnonzero(bits)
        if len(allowed) > _WHOLE:
            return
        keep = np.zeros_like(bits)
        m = self.matcher
        for t in allowed:
            t = int(t)
            if t in self.eos_ids:
                keep[t] = True
            elif m.try_consume_tokens([t]) == 1:
                keep[t] = m.is_accepting()
                m.rollback(1)
        if keep.any():
            packed = np.zeros(row.size * 32, np.uint8)
            packed[:V] = keep
            row[:] = np.packbits(packed, bitorder="little").view(np.int32)

    def _fits_after(self, token: int, room: int) -> bool:
        if token in self.eos_ids:
            return True
        m = self.matcher.deep_copy()
        if not m.consume_token(token) or m.is_stopped():
            return True
        found = closing_walk(m, self._byte_token)
        return found is None or len(found[0]) + (0 if found[1] else 1) <= room

    def _ensure_s(self) -> bytes | None:
        if self._s is None and self._stale is not None:
            m = self.matcher.deep_copy()
            if _consume(m, self._stale, self._byte_token) and m.is_accepting():
                self._s, self._end = self._stale, 0 if m.is_stopped() else 1
            self._stale = None
        if self._s is None:  # the search at the start (the minimum), the walk after
            found = closing_walk(self.matcher, self._byte_token) if self._started else None
            if found is None:
                found = shortest(self.matcher, self._byte_token)
            if found is None:
                return None
            self._s, stopped = found
            self._end = 0 if stopped else 1
        return self._s

    def _ensure_plan(self) -> list[int] | None:
        """The tokens that spell S from the matcher's state, each the longest the
        grammar's mask allows there (llguidance may allow only one tokenization of bytes
        it forces), EOS last where the grammar takes more after S."""
        if self._plan is not None:
            return self._plan
        if self.matcher.is_stopped() or self._ensure_s() is None:
            return None
        m, S, plan = self.matcher.deep_copy(), self._s, []
        while S:
            llguidance.numpy.fill_next_token_bitmask(m, self._scratch, 0)
            bits = self._scratch[0]
            tok = next((i for k in range(min(len(S), self.table.longest), 0, -1)
                        for i in self.table.ids.get(S[:k], ())
                        if i < self.vocab_size and (int(bits[i // 32]) >> (i % 32)) & 1), None)
            if tok is None or not m.consume_token(tok):
                return None
            plan.append(tok)
            S = S[len(self.table.bytes[tok]):]
        if not m.is_stopped():
            eos = [i for i in self.eos_ids if m.is_accepting()]
            if not eos:
                return None
            plan.append(eos[0])
        self._plan = plan
        return plan


def _byte_tokens(table: GrowthTable) -> dict[int, int]:
    """byte value -> a token that is exactly that byte."""
    return {b[0]: ids[0] for b, ids in table.ids.items() if len(b) == 1}


def shortest(matcher: llguidance.LLMatcher, byte_token: dict[int, int]
             ) -> tuple[bytes, bool] | None:
    """(a shortest completion found from the matcher's state, whether the grammar takes
    nothing more after it); None when the narrow search finds none. The matcher is not
    changed (the search runs on copies)."""
    order = itertools.count()
    heap = [(0, next(order), b"", matcher.deep_copy(), None)]
    per_length: dict[int, int] = {}
    nodes = 0
    while heap and nodes < _MAX_NODES:
        n, _, text, m, parent = heapq.heappop(heap)
        if m.is_accepting() or m.is_stopped():
            return text, m.is_stopped()
        nodes += 1
        forced = m.compute_ff_bytes()
        if forced:
            if _consume(m, forced, byte_token):
                heapq.heappush(heap, (n + len(forced), next(order), text + forced, m, None))
            continue
        children = _children(m, byte_token)
        # A byte after which the grammar allows the same bytes as before it most likely
        # wrote more of the same string or number: no way to a shorter end.
        if tuple(children) == parent or n + 1 > _MAX_BYTES:
            continue
        for b in children:
            if per_length.get(n + 1, 0) >= _WIDTH:
                break
            child = m.deep_copy()
            child.consume_token(byte_token[b])
            per_length[n + 1] = per_length.get(n + 1, 0) + 1
            heapq.heappush(heap, (n + 1, next(order), text + bytes([b]), child,
                                  tuple(children)))
    return None


def closing_walk(matcher: llguidance.LLMatcher, byte_token: dict[int, int]
                 ) -> tuple[bytes, bool] | None:
    """A completion found cheaply (as `shortest`, not always the shortest): one path,
    forced bytes taken at once, else the first byte (closing ones first) that closes a
    container or after which the grammar forces or allows other bytes than before it;
    None at a dead end (the caller then searches)."""
    m, text = matcher.deep_copy(), b""
    while len(text) <= _MAX_BYTES:
        if m.is_accepting() or m.is_stopped():
            return text, m.is_stopped()
        forced = m.compute_ff_bytes()
        if forced:
            if not _consume(m, forced, byte_token):
                return None
            text += forced
            continue
        here = _signature(m, byte_token)
        for b in _ORDER:
            if not _allows(m, b, byte_token):
                continue
            m.consume_token(byte_token[b])
            if m.is_accepting() or b in _CLOSERS or _signature(m, byte_token) != here:
                text += bytes([b])
                break
            m.rollback(1)
        else:
            return None
    return None


def _signature(m: llguidance.LLMatcher, byte_token: dict[int, int]) -> tuple:
    """The bytes the grammar forces next and which of the closing bytes it allows (more
    of a string or a number leaves both as they were)."""
    return m.compute_ff_bytes(), tuple(_allows(m, b, byte_token) for b in _CLOSING_FIRST)


def _consume(m: llguidance.LLMatcher, data: bytes, byte_token: dict[int, int]) -> bool:
    ids = [byte_token.get(b) for b in data]
    return None not in ids and m.try_consume_tokens(ids) == len(ids)


def _children(m: llguidance.LLMatcher, byte_token: dict[int, int]) -> list[int]:
    """The bytes the matcher takes next that the search follows: the closing ones it
    allows, then the first few others in byte order."""
    out = []
    for b in _CLOSING_FIRST:
        if _allows(m, b, byte_token):
            out.append(b)
    found = 0
    for b in _SCAN:
        if found == _FALLBACKS:
            break
        if b not in _CLOSING_FIRST and _allows(m, b, byte_token):
            out.append(b)
            found += 1
    return out


def _allows(m: llguidance.LLMatcher, b: int, byte_token: dict[int, int]) -> bool:
    t = byte_token.get(b)
    if t is None or m.try_consume_tokens([t]) != 1:
        return False
    m.rollback(1)
    return True

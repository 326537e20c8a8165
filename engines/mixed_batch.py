"""The host side of a mixed step: which rows run, as the arrays the jitted step takes.

A mixed step (engines/mixed_step.py) runs one flat batch of tokens over the paged decode
state's B slots ("rows"). The scheduler says what each row does this step, as `MixedRow`s:

  - a decode row: `MixedRow(slot=s)`: one token, the one the slot sampled last (still on
    the device, so the host never waits for it), at the slot's length;
  - a prefill row: `MixedRow(slot=s, chunk=ids, start=n, last=..., sampling=...)`: the
    prompt tokens at positions n .. n + len(ids) - 1 of the slot (n tokens of the prompt
    went before). `sampling` (with `seed`) marks the prompt's first chunk: the slot's
    sampling row, prompt mask and token counts start afresh. `last`: the chunk ends the
    prompt, so the row samples its first token, and from then on the slot decodes.
    `adapter` (every chunk of the prompt): the LoRA adapter it runs through, by name
    (None: the base model); a LoRA engine (engines/lora_engine.py) keeps it for the
    slot's decode rows once the chunk that ends the prompt has run. `context` (a first
    chunk only, one that starts after a prefix-cache hit's linked pages): the tokens of
    positions 0 .. n - 1, whose keys and values the pages hold already; speculative
    decoding writes them into the slot's token history and a draft model's cache before
    the step (engines/paged_engine.py), so drafts see the whole prompt.
  - any other slot is idle: the step leaves its state bit-identical.

`pack_rows` lays the rows out in slot order (the order the TPU kernel's cumulative query
lengths need), pads the tokens to a bucket of `token_buckets` (one compiled program per
bucket and page-table width) and checks what the host can check.
Plain numpy but for the RNG key of a fresh row (jax.random, as prefill makes its own).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

import jax
import numpy as np

from engines.kv_cache import window_sizes
from engines.sampling import SamplingParams, SlotSampling

MODE_IDLE, MODE_DECODE, MODE_CHUNK = 0, 1, 2
MIN_TOKENS = 8  # the smallest token bucket
CHUNK_BUCKETS_FROM = 64  # chunks this long or longer get a bucket with the decode rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedRow:
    """What one slot does in a mixed step (see the module doc)."""

    slot: int
    chunk: tuple[int, ...] = ()  # prompt token ids; empty: a decode row
    start: int = 0  # position of chunk[0]
    last: bool = False  # the chunk ends its prompt: sample the first token
    sampling: SamplingParams | None = None  # the prompt's first chunk: the slot starts afresh
    seed: int | None = None  # with `sampling`: its RNG seed (None: sampling.seed or random)
    adapter: str | None = None  # a chunk's LoRA adapter (None: the base model)
    context: tuple[int, ...] = ()  # a first chunk after a prefix-cache hit: positions < start

    def __post_init__(self):
        object.__setattr__(self, "chunk", tuple(int(t) for t in self.chunk))
        object.__setattr__(self, "context", tuple(int(t) for t in self.context))
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        if self.context and (self.sampling is None or len(self.context) != self.start):
            raise ValueError(f"slot {self.slot}: context is the tokens before a prompt's "
                             f"first chunk (start {self.start}), got {len(self.context)} "
                             f"tokens{'' if self.sampling else ' on a later chunk'}")
        if not self.chunk and (self.last or self.sampling is not None or self.start
                               or self.adapter is not None):
            raise ValueError(f"slot {self.slot}: a decode row (empty chunk) takes no start, "
                             "last, sampling or adapter (it decodes through its slot's)")

    @property
    def decode(self) -> bool:
        return not self.chunk


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MixedInputs:
    """A mixed step's inputs beside the page table (numpy on the host, B rows, T tokens)."""

    tokens: np.ndarray  # i32[T] prefill rows' tokens in slot order (decode entries unused)
    mode: np.ndarray  # i32[B] MODE_IDLE / MODE_DECODE / MODE_CHUNK
    q_len: np.ndarray  # i32[B] the row's tokens this step (0, a decode row's, its chunk's)
    start: np.ndarray  # i32[B] a chunk's first position
    sample: np.ndarray  # bool[B] a chunk that ends its prompt (decode rows always sample)
    fresh: np.ndarray  # bool[B] a prompt's first chunk: sampling / mask / counts start over
    sampling: SlotSampling  # [B] the fresh rows' parameters (others unused)


def token_buckets(max_tokens: int, decode_tokens: int = 0) -> tuple[int, ...]:
    """The padded token counts a mixed step compiles for: powers of two from MIN_TOKENS
    below max_tokens, then max_tokens rounded up to a multiple of 8. The top bucket is
    the common full step (a whole chunk beside every decode row: 128 + 8), which the next
    power of two would pad to almost twice its work. For the same reason each power of
    two p from CHUNK_BUCKETS_FROM up that is below max_tokens comes with p + decode_tokens
    (rounded up to 8; decode_tokens: every slot's decode row): a prompt of p tokens beside
    the running rows (128 + 8 in a 520-token budget) pads to 136, not to 256."""
    top = -(-max_tokens // 8) * 8
    powers = window_sizes(top, MIN_TOKENS)
    extra = {-(-(p + decode_tokens) // 8) * 8 for p in powers[:-1]
             if p >= CHUNK_BUCKETS_FROM and decode_tokens}
    return tuple(sorted({*powers, *(b for b in extra if b < top)}))


def _sampling_rows(B: int, rows: Sequence[MixedRow]) -> SlotSampling:
    empty = SlotSampling.empty(B)
    fields = {f.name: np.array(getattr(empty, f.name)) for f in dataclasses.fields(empty)}
    for r in rows:
        if r.sampling is None:
            continue
        seed = r.seed if r.seed is not None else (
            r.sampling.seed if r.sampling.seed is not None else secrets.randbits(31))
        one = SlotSampling.from_params(r.sampling, seed)
        for name, arr in fields.items():
            arr[r.slot] = np.asarray(getattr(one, name))[0]
    return SlotSampling(**fields)


def pack_rows(rows: Sequence[MixedRow], *, slots: int, max_seq_len: int,
              buckets: Sequence[int], decode_tokens: int = 1) -> MixedInputs:
    """The rows of one step as MixedInputs, tokens padded to the smallest bucket that
    holds them; `decode_tokens`: the tokens a decode row runs (k + 1 for a verify row of
    k drafts, which the device fills in). Raises ValueError naming the field for a row
    the step cannot run."""
    by_slot: dict[int, MixedRow] = {}
    for r in rows:
        if not 0 <= r.slot < slots:
            raise ValueError(f"slot {r.slot} out of range [0, {slots})")
        if r.slot in by_slot:
            raise ValueError(f"slot {r.slot} appears twice in one mixed step")
        if r.start + len(r.chunk) > max_seq_len:
            raise ValueError(f"slot {r.slot}: chunk ends at position "
                             f"{r.start + len(r.chunk)}, past max_seq_len {max_seq_len}")
        by_slot[r.slot] = r
    total = sum(len(r.chunk) or decode_tokens for r in by_slot.values())
    fits = [b for b in buckets if b >= total]
    if not fits:
        raise ValueError(f"a mixed step of {total} tokens exceeds the largest token bucket "
                         f"{max(buckets)}")
    tokens = np.zeros((fits[0],), np.int32)
    mode = np.zeros((slots,), np.int32)
    q_len = np.zeros((slots,), np.int32)
    start = np.zeros((slots,), np.int32)
    sample = np.zeros((slots,), bool)
    fresh = np.zeros((slots,), bool)
    at = 0
    for s in sorted(by_slot):
        r = by_slot[s]
        n = len(r.chunk) or decode_tokens
        mode[s] = MODE_DECODE if r.decode else MODE_CHUNK
        q_len[s], start[s] = n, r.start
        sample[s] = r.decode or r.last
        fresh[s] = r.sampling is not None
        tokens[at:at + len(r.chunk)] = r.chunk
        at += n
    return MixedInputs(tokens=tokens, mode=mode, q_len=q_len, start=start, sample=sample,
                       fresh=fresh, sampling=_sampling_rows(slots, list(by_slot.values())))

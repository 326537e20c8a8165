"""The Engine contract: what the orchestrator may ask of a set of devices.

An engine owns one slice of devices and one copy of the weights. Device math happens in
three pure functions, each jitted once per shape bucket by the implementation:

    prefill(params, tokens, true_length, sampling)  -> (Prefix, ResultTokens)
    insert(prefix, decode_state, slot[, pages])     -> DecodeState
    generate(params, decode_state[, page_table])    -> (DecodeState, ResultTokens)

The engine object holds compiled functions, shardings and params, never per-slot host
state: a paged KV cache's page table is an input (`pages`, `page_table`), planned on the
host before each call (jetserve/scheduling/page_planner.py) from the engine's
`page_geometry`.

`ResultTokens` packs every per-slot output of one step (one token per slot, or several
with speculative decoding) into a single int32 array so the host copies one buffer
(`copy_to_host_async`) while the next step is already running.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

# Column layout of ResultTokens.data (int32[B, C]). One step gives each slot up to T
# tokens (T = 1, or K + 1 with K speculative drafts); a row holds its count, the sequence
# length after the step, T itself, then T token ids, their T log-probs, and T x top_n
# alternatives (ids, then log-probs). Log-probs are float32 bit-cast to int32 so one array
# carries everything.
COL_COUNT = 0  # tokens this step gave the slot (0: the slot was not live)
COL_LENGTH = 1  # prompt + generated tokens after this step
COL_WIDTH = 2  # T
COL_TOKENS = 3  # then T token ids, T log-prob bits, T*n top ids, T*n top log-prob bits


def result_columns(top_n: int, width: int = 1) -> int:
    """Number of int32 columns in ResultTokens.data for `width` tokens per slot with
    `top_n` alternative log-probs each."""
    return COL_TOKENS + width * (2 + 2 * top_n)


def pack_results(
    tokens: jax.Array,  # i32[B] or i32[B, T]
    counts: jax.Array,  # i32[B] tokens valid per slot (a bool[B] "valid" counts as 0/1)
    lengths: jax.Array,  # i32[B]
    logprob: jax.Array,  # f32[B] or f32[B, T]
    top_ids: jax.Array,  # i32[B, n] or i32[B, T, n]
    top_logprobs: jax.Array,  # f32[B, n] or f32[B, T, n]
) -> ResultTokens:
    """Packs one step's per-slot outputs into a single int32[B, C] array (device side)."""
    if tokens.ndim == 1:  # one token per slot
        tokens, logprob = tokens[:, None], logprob[:, None]
        top_ids, top_logprobs = top_ids[:, None], top_logprobs[:, None]
    B, T = tokens.shape
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    data = jnp.concatenate(
        [
            counts[:, None].astype(jnp.int32),
            lengths[:, None].astype(jnp.int32),
            jnp.full((B, 1), T, jnp.int32),
            tokens.astype(jnp.int32),
            bits(logprob),
            top_ids.astype(jnp.int32).reshape(B, -1),
            bits(top_logprobs).reshape(B, -1),
        ],
        axis=1,
    )
    return ResultTokens(data=data)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ResultTokens:
    """One step's outputs for every slot, packed as int32[B, C] (see COL_*)."""

    data: jax.Array

    def copy_to_host_async(self) -> None:
        """Starts the device-to-host copy; `to_host` later returns without waiting long."""
        if isinstance(self.data, jax.Array):
            self.data.copy_to_host_async()

    def to_host(self) -> HostResults:
        return HostResults(np.asarray(self.data))


@dataclasses.dataclass(frozen=True)
class HostResults:
    """ResultTokens on the host, with named accessors over the packed columns. `i` picks
    one of a slot's tokens of this step (0 <= i < count(slot))."""

    data: np.ndarray  # i32[B, C]

    @property
    def width(self) -> int:
        return int(self.data[0, COL_WIDTH])

    @property
    def top_n(self) -> int:
        T = self.width
        return (self.data.shape[1] - COL_TOKENS - 2 * T) // (2 * T)

    def count(self, slot: int) -> int:
        return int(self.data[slot, COL_COUNT])

    def valid(self, slot: int) -> bool:
        return self.count(slot) > 0

    def length(self, slot: int) -> int:
        return int(self.data[slot, COL_LENGTH])

    def drafts(self, slot: int) -> tuple[int, int]:
        """(draft tokens proposed, drafts the target accepted) for the slot this step:
        (0, 0) without speculative decoding or for a slot that was not live."""
        n = self.count(slot)
        return (self.width - 1, n - 1) if n else (0, 0)

    def token(self, slot: int, i: int = 0) -> int:
        return int(self.data[slot, COL_TOKENS + i])

    def tokens(self, slot: int) -> list[int]:
        """The slot's tokens of this step, in order."""
        return self.data[slot, COL_TOKENS : COL_TOKENS + self.count(slot)].tolist()

    def logprob(self, slot: int, i: int = 0) -> float:
        c = COL_TOKENS + self.width + i
        return float(self.data[slot, c : c + 1].view(np.float32)[0])

    def top_logprobs(self, slot: int, i: int = 0) -> list[tuple[int, float]]:
        T, n = self.width, self.top_n
        ids_at = COL_TOKENS + 2 * T + i * n
        lps_at = COL_TOKENS + 2 * T + T * n + i * n
        ids = self.data[slot, ids_at : ids_at + n]
        lps = self.data[slot, lps_at : lps_at + n].copy().view(np.float32)
        return [(int(i), float(lp)) for i, lp in zip(ids, lps, strict=True)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PageGeometry:
    """The shape of a paged KV cache: what the host needs to plan its page table.

    `num_pages` None: enough for every slot at max_seq_len. The device keeps one page
    past the pool (`trash`) as scratch: table entries a slot does not hold point there.
    `lookahead`: positions past a slot's length one step writes (speculative drafts K).
    """

    slots: int
    page_size: int
    max_seq_len: int
    num_pages: int | None = None
    lookahead: int = 0
    # Layers with a bounded reach keep a ring of `ring_pages` pages per slot instead of
    # pages of the pool (engines/paged_kv.py WindowRing): `ring_layers` of them; 0: none.
    ring_pages: int = 0
    ring_layers: int = 0
    # Device bytes (the paged engine fills them in): one page of the pool over every layer
    # in it, keys and values; every slot's ring over its layers.
    page_bytes: int = 0
    ring_bytes: int = 0

    def __post_init__(self):
        for name in ("slots", "page_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.num_pages is None:
            object.__setattr__(self, "num_pages", self.slots * self.max_pages)
        if self.num_pages < self.max_pages:
            raise ValueError(
                f"num_pages={self.num_pages} cannot hold one sequence of max_seq_len="
                f"{self.max_seq_len} ({self.max_pages} pages of {self.page_size}); give at "
                f"least {self.max_pages}")

    @property
    def max_pages(self) -> int:
        """Pages of one sequence of max_seq_len tokens (a page-table row)."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def trash(self) -> int:
        return self.num_pages


class Tokenizer(Protocol):
    """What an engine's tokenizer offers the host runtime (see jetserve.tokenizer)."""

    vocab_size: int
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str, *, add_bos: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Engine(abc.ABC):
    """One slice of devices and one copy of the weights.

    The three device functions are pure: they take and return pytrees and never touch
    `self` state, so the orchestrator can run them from its own threads.
    """

    @abc.abstractmethod
    def load_params(self) -> Any:
        """Returns the parameter pytree placed with this engine's sharding."""

    @abc.abstractmethod
    def init_decode_state(self) -> Any:
        """Returns an empty DecodeState with `max_concurrent_decodes` slots."""

    @abc.abstractmethod
    def prefill(
        self,
        params: Any,
        tokens: np.ndarray | jax.Array,
        true_length: int,
        *,
        sampling: Any,
        existing_prefix: Any | None = None,
        donate: bool = False,
    ) -> tuple[Any, ResultTokens]:
        """Runs a prompt (padded to a bucket); returns its Prefix and the first token.
        `donate=True`: the caller never reads `existing_prefix` again (a chunk loop), so
        the engine may update its KV in place rather than copy it; a prefix other
        requests share (the prefix cache's) is never donated.
        The transformer engines also take `token_mask=` (i32[1, W], engines/token_mask.py):
        the tokens the first one may be (structured output)."""

    def prefill_rows(self, params: Any, prompts: Sequence[np.ndarray], *,
                     samplings: Sequence[Any], seeds: Sequence[int | None] | None = None
                     ) -> tuple[list[Any], ResultTokens]:
        """Several fresh, whole prompts in one call (no existing prefix, no token mask):
        one Prefix per prompt, each as `prefill` makes it alone, and ResultTokens with a row
        per prompt. Takes as many prompts as `prefill_rows_for` says; engines that take
        one prompt per call (`prefill_row_shapes()` empty) do not implement it."""
        raise NotImplementedError(f"{type(self).__name__} prefills one prompt per call")

    def prefill_row_shapes(self) -> list[tuple[int, int]]:
        """Every (prompts, bucket) a `prefill_rows` call compiles; empty: one prompt per
        prefill call."""
        return []

    def prefill_rows_for(self, waiting: int, longest: int) -> int:
        """How many of `waiting` prompts, the longest `longest` tokens, one `prefill_rows`
        call takes (1: a plain `prefill`)."""
        del waiting, longest
        return 1

    def empty_prefix(self, length: int) -> Any | None:
        """A prefix holding nothing, with room for a `length`-token prompt, for a chunk
        loop to start from: its first chunk continues it (`existing_prefix`) and every
        chunk donates, so the prompt's KV is allocated once at its final size rather than
        grown (copied) as chunks arrive. None where the engine has none: start from no
        prefix."""
        del length
        return None

    @abc.abstractmethod
    def insert(self, prefix: Any, decode_state: Any, slot: int) -> Any:
        """Writes `prefix` into `slot`; every other slot is left bit-identical. A paged
        engine also takes `pages=` (the slot's pages, in position order) and `shared=`
        (how many of them already hold the prefix's head and are not written)."""

    @abc.abstractmethod
    def generate(self, params: Any, decode_state: Any) -> tuple[Any, ResultTokens]:
        """One decode step for every slot; never waits on the host. A paged engine also
        takes the step's page table (i32[B, W], the pages it writes included). The
        transformer engines take `token_mask=` (None, or i32[B, W'] each slot's allowed
        tokens: engines/token_mask.py; with speculative decoding i32[B, K+1, W'], one per
        position the verify step samples), compiled as a second program beside the one
        without, so steps with no constrained slot cost what they did. An engine with
        `decode_batch_sizes` below max_concurrent_decodes takes `rows=` (one of them):
        the step runs the first `rows` slots only, the others untouched and without a
        token in the results (their rows say none)."""

    def move_slot(self, decode_state: Any, src: int, dst: int) -> Any:
        """Copies slot `src` (its cache and sampling state) into the free slot `dst`, so a
        running request goes on from there; src is the caller's to free. Engines with
        several `decode_batch_sizes` implement it: moving requests down to free low slots
        lets the step run fewer of them."""
        raise NotImplementedError(f"{type(self).__name__} does not move slots")

    @property
    def decode_batch_sizes(self) -> tuple[int, ...]:
        """The slot counts a generate step is compiled for, ascending, the last
        max_concurrent_decodes: a caller whose slots in use all lie below a smaller one
        passes it as `rows=` and the step costs what that batch does."""
        return (self.max_concurrent_decodes,)

    def free_slot(self, slot: int) -> None:
        """Returns the slot's host resources (its pages, in the page planner); the engine
        itself holds none."""
        del slot

    @property
    def page_geometry(self) -> PageGeometry | None:
        """A paged engine's pool shape, which the host plans pages by; None when the KV
        cache is contiguous."""
        return None

    @property
    def chunked_prefill(self) -> bool:
        """Whether prefill continues an `existing_prefix`, so a prompt longer than
        max_prefill_length is prefilled in chunks (up to max_seq_len); False: one prefill
        per prompt, at most max_prefill_length tokens."""
        return False

    @property
    def kv_pages(self) -> Any | None:
        """The page bookkeeping (jetserve.scheduling.page_pool.SlotPages) the scheduler
        reads to admit by free pages and to preempt: a PagePlanner's, over a paged engine;
        None when contiguous."""
        return None

    @abc.abstractmethod
    def prefix_destination_sharding(self) -> Any:
        """Pytree of shardings a Prefix must have to be inserted into this engine."""

    @property
    @abc.abstractmethod
    def max_concurrent_decodes(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_prefill_length(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def mesh(self) -> jax.sharding.Mesh: ...

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def top_logprobs(self) -> int:
        """How many alternative log-probs each ResultTokens row carries."""
        return 0

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eos_ids(self) -> tuple[int, ...]:
        tok = self.tokenizer
        return tuple(tok.eos_ids) if tok is not None else ()

    @property
    def bos_id(self) -> int | None:
        tok = self.tokenizer
        return tok.bos_id if tok is not None else None

    def prefill_buckets(self) -> tuple[int, ...]:
        """Padded prompt lengths: powers of two from 16, capped by max_prefill_length."""
        return prefill_buckets(self.max_prefill_length)

    def bucket_for(self, length: int) -> int:
        for b in self.prefill_buckets():
            if length <= b:
                return b
        raise ValueError(
            f"prompt length {length} exceeds max_prefill_length {self.max_prefill_length}"
        )


def prefill_buckets(max_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_len`, then `max_len` itself."""
    if max_len < 1:
        raise ValueError(f"max_prefill_length must be >= 1, got {max_len}")
    out = []
    b = smallest
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return tuple(out)

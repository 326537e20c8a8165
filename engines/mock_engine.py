"""MockEngine: the Engine contract with hand-computable outputs, for orchestrator tests.

Arithmetic (V = vocab_size):
  prefill: first token = sum(prompt tokens) mod V
  generate: next token = (previous token + 1) mod V, for every slot
  log-prob of a token t = -(t mod 4) / 4
So a request with prompt [3, 4] streams 7, 8, 9, ... and a slot mix-up is visible at once.
With `speculative=K` a step gives a slot whose cache holds n tokens 1 + (n mod (K + 1))
tokens of that same stream (as if n mod (K + 1) of K drafts were accepted), capped by the
room left: the output equals the plain run's, in steps of varying size.
Its tokenizer is byte-level (token id = UTF-8 byte), so text and stop strings can be tested.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engines.engine_api import Engine, ResultTokens, pack_results


class ByteTokenizer:
    """Token id i is the byte i; decoding is UTF-8 with replacement."""

    vocab_size = 256

    def __init__(self, bos_id: int | None = None, eos_ids: tuple[int, ...] = ()):
        self.bos_id = bos_id
        self.eos_ids = eos_ids

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos and self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def encode_verbatim(self, text: str) -> list[int]:
        """Ids that spell `text` exactly (a grammar's tokenize, structured/vocabulary.py)."""
        return self.encode(text)

    def id_to_bytes(self, i: int) -> bytes:
        return bytes([i]) if 0 <= i < 256 else b""

    def token_bytes(self, i: int) -> bytes | None:
        """The byte token `i` stands for; None for an EOS id, which stands for no text
        (what a grammar reads, jetserve/structured/vocabulary.py)."""
        return None if int(i) in self.eos_ids else self.id_to_bytes(int(i))

    def id_to_piece(self, i: int) -> str:
        return f"<0x{int(i):02X}>"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MockPrefix:
    length: jax.Array  # i32[]
    token: jax.Array  # i32[]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MockDecodeState:
    lengths: jax.Array  # i32[B]
    tokens: jax.Array  # i32[B]


def _logprob(t):
    return -(t % 4).astype(jnp.float32) / 4.0


class MockEngine(Engine):
    """Hand-computable engine. `step_delay_s` makes generate take wall time (for timing);
    `speculative=K` gives up to K + 1 tokens per slot and step (see module doc)."""

    def __init__(self, *, max_concurrent_decodes: int = 4, max_prefill_length: int = 64,
                 max_seq_len: int = 128, vocab_size: int = 256,
                 devices: Sequence[jax.Device] | None = None, eos_ids: tuple[int, ...] = (),
                 step_delay_s: float = 0.0, speculative: int = 0):
        self._B = max_concurrent_decodes
        self._P = max_prefill_length
        self._S = max_seq_len
        self._V = vocab_size
        devs = list(devices) if devices is not None else jax.devices()[:1]
        self._mesh = Mesh(np.asarray(devs[:1]), ("x",))
        self._tok = ByteTokenizer(eos_ids=eos_ids)
        self.step_delay_s = step_delay_s
        rep = NamedSharding(self._mesh, PartitionSpec())
        V, S, T = self._V, self._S, speculative + 1

        def prefill(tokens, true_length):
            idx = jnp.arange(tokens.shape[0])
            first = jnp.sum(jnp.where(idx < true_length, tokens, 0)) % V
            res = pack_results(first[None], jnp.ones((1,), bool), (true_length + 1)[None],
                               _logprob(first)[None], jnp.zeros((1, 0), jnp.int32),
                               jnp.zeros((1, 0), jnp.float32))
            return MockPrefix(length=true_length, token=first.astype(jnp.int32)), res

        def insert(prefix, state, slot):
            return MockDecodeState(lengths=state.lengths.at[slot].set(prefix.length),
                                   tokens=state.tokens.at[slot].set(prefix.token))

        def generate(state):
            count = jnp.minimum(1 + state.lengths % T, S - state.lengths)  # 0 when full
            toks = (state.tokens[:, None] + 1 + jnp.arange(T)[None, :]) % V  # (B, T)
            last = jnp.take_along_axis(toks, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
            tok = jnp.where(count > 0, last, state.tokens).astype(jnp.int32)
            lengths = state.lengths + count
            B = tok.shape[0]
            res = pack_results(toks.astype(jnp.int32), count, lengths + 1, _logprob(toks),
                               jnp.zeros((B, T, 0), jnp.int32), jnp.zeros((B, T, 0), jnp.float32))
            return MockDecodeState(lengths=lengths, tokens=tok), res

        self._prefill = jax.jit(prefill, out_shardings=(self.prefix_destination_sharding(), rep))
        self._insert = jax.jit(insert, donate_argnums=(1,))
        self._generate = jax.jit(generate, donate_argnums=(0,))
        self._rep = rep

    def load_params(self):
        return jnp.zeros((), jnp.float32)

    def init_decode_state(self) -> MockDecodeState:
        B = self._B
        return MockDecodeState(lengths=jnp.full((B,), self._S, jnp.int32),
                               tokens=jnp.zeros((B,), jnp.int32))

    def prefill(self, params, tokens, true_length, *, sampling=None, existing_prefix=None,
                seed=None, donate=False):
        del params, sampling, seed, donate
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        true_length = int(true_length)
        if existing_prefix is not None:
            raise NotImplementedError("MockEngine does not continue prefixes")
        if not 1 <= true_length <= min(tokens.shape[0], self._P):
            raise ValueError(f"true_length {true_length} out of range for MockEngine")
        padded = np.zeros((self.bucket_for(tokens.shape[0]),), np.int32)
        padded[: tokens.shape[0]] = tokens
        return self._prefill(padded, np.int32(true_length))

    def insert(self, prefix, decode_state, slot):
        return self._insert(prefix, decode_state, np.int32(slot))

    def generate(self, params, decode_state) -> tuple[MockDecodeState, ResultTokens]:
        del params
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        return self._generate(decode_state)

    def prefix_destination_sharding(self):
        rep = NamedSharding(self._mesh, PartitionSpec())
        return MockPrefix(length=rep, token=rep)

    @property
    def max_concurrent_decodes(self) -> int:
        return self._B

    @property
    def max_prefill_length(self) -> int:
        return self._P

    @property
    def max_seq_len(self) -> int:
        return self._S

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._V

"""Per-slot sampling inside the jitted step.

`SamplingParams` is the host-side description of how one request samples. On the device
each slot carries its parameters as arrays (`SlotSampling`, leading dim B), so one batched
step serves requests that all sample differently: greedy, temperature, top-k, top-p,
min-p, repetition / frequency / presence penalties, logit bias, each with its own RNG key.

A logit bias (OpenAI's `logit_bias`: token id -> value added to its logit) travels in a
fixed sparse form, MAX_LOGIT_BIAS (id, value) pairs per slot padded with (0, 0.0), so a
request with a bias, or without, runs the same compiled step.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import engines.cpu_kernels
from engines.token_mask import apply_token_mask

_NEG_INF = -1e30
_INT32_MAX = 2**31 - 1
# OpenAI's limits on logit_bias: at most 300 tokens, each value in [-100, 100].
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    # (token id, value) pairs, ids ascending (a dict {id: value} is accepted and sorted).
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        def finite(name, lo, hi):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v!r}")

        finite("temperature", 0.0, 100.0)
        finite("top_p", 0.0, 1.0)
        finite("min_p", 0.0, 1.0)
        finite("repetition_penalty", 1e-3, 100.0)
        finite("frequency_penalty", -2.0, 2.0)
        finite("presence_penalty", -2.0, 2.0)
        # top_k becomes an int32 on the device: a larger one would overflow there.
        if (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                or not 0 <= self.top_k <= _INT32_MAX):
            raise ValueError(f"top_k must be an integer in [0, {_INT32_MAX}], "
                             f"got {self.top_k!r}")
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be > 0, got {self.top_p!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0
        ):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        object.__setattr__(self, "logit_bias", _check_logit_bias(self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """`bias` ({id: value} or (id, value) pairs) as sorted pairs; ValueError naming
    logit_bias otherwise. Ids against the model's vocabulary are the server's to check."""
    pairs = list(bias.items()) if isinstance(bias, dict) else list(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, "
                         f"got {len(pairs)}")
    out = {}
    for pair in pairs:
        tok, val = pair
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok <= _INT32_MAX:
            raise ValueError(f"logit_bias token ids must be non-negative integers, got {tok!r}")
        if (not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val)
                or not -LOGIT_BIAS_RANGE <= val <= LOGIT_BIAS_RANGE):
            raise ValueError(f"logit_bias[{tok}] must be a number in [-{LOGIT_BIAS_RANGE:g}, "
                             f"{LOGIT_BIAS_RANGE:g}], got {val!r}")
        if tok in out:
            raise ValueError(f"logit_bias names token {tok} twice")
        out[tok] = float(val)
    return tuple(sorted(out.items()))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotSampling:
    """Sampling parameters as device arrays, one row per slot (leading dim B)."""

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    key: jax.Array  # u32[B, 2] raw PRNG key data
    bias_ids: jax.Array  # i32[B, MAX_LOGIT_BIAS] logit_bias token ids, padded with 0
    bias_values: jax.Array  # f32[B, MAX_LOGIT_BIAS] their values, padded with 0.0

    @staticmethod
    def from_params(p: SamplingParams, seed: int) -> SlotSampling:
        """A single-row SlotSampling (B=1) built on the host (numpy: each jax op here would
        be one more program to trace and compile before a process's first token)."""
        f = lambda x: np.asarray([x], np.float32)
        ids = np.zeros((1, MAX_LOGIT_BIAS), np.int32)
        values = np.zeros((1, MAX_LOGIT_BIAS), np.float32)
        for i, (tok, val) in enumerate(p.logit_bias):
            ids[0, i], values[0, i] = tok, val
        return SlotSampling(
            temperature=f(p.temperature),
            top_k=np.asarray([p.top_k], np.int32),
            top_p=f(p.top_p),
            min_p=f(p.min_p),
            repetition_penalty=f(p.repetition_penalty),
            frequency_penalty=f(p.frequency_penalty),
            presence_penalty=f(p.presence_penalty),
            key=key_data(seed)[None],
            bias_ids=ids,
            bias_values=values,
        )

    @staticmethod
    def empty(batch: int) -> SlotSampling:
        z = jnp.zeros((batch,), jnp.float32)
        return SlotSampling(
            temperature=z,
            top_k=jnp.zeros((batch,), jnp.int32),
            top_p=jnp.ones((batch,), jnp.float32),
            min_p=z,
            repetition_penalty=jnp.ones((batch,), jnp.float32),
            frequency_penalty=z,
            presence_penalty=z,
            key=jnp.zeros((batch, 2), jnp.uint32),
            bias_ids=jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.int32),
            bias_values=jnp.zeros((batch, MAX_LOGIT_BIAS), jnp.float32),
        )


def key_data(seed: int) -> np.ndarray:
    """u32[2]: jax.random.key_data(jax.random.key(seed)), on the host where that is plain:
    jax's default threefry key of a seed below 2**32 is [0, seed]. Anything else asks jax."""
    if jax.config.jax_default_prng_impl == "threefry2x32" and 0 <= seed < 1 << 32:
        return np.array([0, seed], np.uint32)
    return np.asarray(jax.random.key_data(jax.random.key(seed)))


def apply_penalties(
    logits: jax.Array,  # f32[B, V]
    s: SlotSampling,
    prompt_mask: jax.Array,  # bool[B, V] tokens seen in the prompt
    counts: jax.Array,  # i32[B, V] generated-token counts
) -> jax.Array:
    """Repetition penalty over prompt and output (as transformers), then OpenAI-style
    frequency / presence penalties over generated tokens only (as vLLM), then the logit
    bias (added, as OpenAI's; before any token mask, which must stay at -inf)."""
    seen = prompt_mask | (counts > 0)
    rp = s.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / rp, logits * rp)
    logits = jnp.where(seen, penalized, logits)
    c = counts.astype(jnp.float32)
    logits = logits - s.frequency_penalty[:, None] * c
    logits = logits - s.presence_penalty[:, None] * (c > 0).astype(jnp.float32)
    return apply_logit_bias(logits, s)


def apply_logit_bias(logits: jax.Array, s: SlotSampling) -> jax.Array:
    """logits f32[B, V] plus each slot's bias pairs; padding adds 0.0 to token 0."""
    rows = jnp.arange(logits.shape[0])[:, None]  # (B, 1)
    return logits.at[rows, s.bias_ids].add(s.bias_values, mode="drop")


def filter_logits(logits: jax.Array, s: SlotSampling) -> jax.Array:
    """Temperature, then top-k, top-p and min-p masks (masked entries -> -inf).

    logits: f32[B, V] already penalized. Returns scaled, masked logits.
    """
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    logits = logits / temp
    V = logits.shape[-1]
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # (B, V) descending
    # top-k: keep logits >= the k-th largest (k = 0 means all).
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, _NEG_INF, logits)
    sorted_logits = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_logits, _NEG_INF)
    # top-p: smallest prefix of the sorted distribution whose mass reaches p.
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < s.top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep_sorted, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
    logits = jnp.where(logits < pth, _NEG_INF, logits)
    # min-p: drop tokens whose probability is below min_p x the top probability.
    probs = jax.nn.softmax(logits, axis=-1)
    pmax = jnp.max(probs, axis=-1, keepdims=True)
    logits = jnp.where(probs < s.min_p[:, None] * pmax, _NEG_INF, logits)
    return logits


def sample(
    logits: jax.Array,  # f32[B, V] raw model logits
    s: SlotSampling,
    prompt_mask: jax.Array,  # bool[B, V]
    counts: jax.Array,  # i32[B, V]
    cpu_kernels: bool = False,
    token_mask: jax.Array | None = None,  # i32[B, W] packed allowed tokens (token_mask.py)
) -> tuple[jax.Array, jax.Array]:
    """Picks one token per slot. Returns (tokens i32[B], next keys u32[B, 2]).

    cpu_kernels: the greedy token by engines.cpu_kernels.argmax (the engine's choice on one
    CPU device; the same token as jnp.argmax). token_mask: structured output's allowed
    tokens, applied after the penalties (which would scale a -inf).
    """
    logits = apply_penalties(logits.astype(jnp.float32), s, prompt_mask, counts)
    if token_mask is not None:
        logits = apply_token_mask(logits, token_mask)
    if cpu_kernels:
        greedy_tok = engines.cpu_kernels.argmax(logits)
    else:
        greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k)))(s.key)
    next_keys = jax.vmap(jax.random.key_data)(keys[:, 0])
    use_keys = keys[:, 1]

    def random_path(_):
        masked = filter_logits(logits, s)
        drawn = jax.vmap(jax.random.categorical)(use_keys, masked).astype(jnp.int32)
        return jnp.where(s.temperature > 0, drawn, greedy_tok)

    any_random = jnp.any(s.temperature > 0)
    tokens = jax.lax.cond(any_random, random_path, lambda _: greedy_tok, None)
    return tokens, next_keys


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, top_n: int, cpu_kernels: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probs of the model's distribution (before penalties and temperature).

    Returns (chosen f32[B], top ids i32[B, n], top log-probs f32[B, n]). cpu_kernels: by
    engines.cpu_kernels.token_logprobs (equal to a few float32 ulps).
    """
    if cpu_kernels:
        return engines.cpu_kernels.token_logprobs(logits.astype(jnp.float32), tokens, top_n,
                                                  fallback=_token_logprobs_xla)
    return _token_logprobs_xla(logits, tokens, top_n)


def _token_logprobs_xla(
    logits: jax.Array, tokens: jax.Array, top_n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if top_n > 0:
        top_lp, top_ids = jax.lax.top_k(logp, top_n)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return chosen, top_ids.astype(jnp.int32), top_lp

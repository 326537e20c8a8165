"""Checks shared by the gRPC and HTTP front ends: from wire values to a valid Request.

Every check raises `InvalidArgument` naming the wire field, the value and what was
expected, so both servers turn it into INVALID_ARGUMENT / HTTP 400 the same way. Plain
functions of a `ModelLimits` snapshot; no state, safe from any thread.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from engines import SamplingParams

# jax.random.key folds a seed into 32 bits; larger seeds would silently collide.
MAX_SEED = 2**32 - 1
MAX_STOP_STRINGS = 16
MAX_SAMPLES = 16


class InvalidArgument(ValueError):
    """A request field the client must fix. `field` is the name on the wire."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """What the served model accepts; read once from the orchestrator."""

    vocab_size: int
    max_prefill_length: int  # the longest prompt admitted (longer with chunked prefill)
    max_seq_len: int
    bos_id: int | None
    eos_ids: tuple[int, ...]
    top_logprobs: int
    tokenizer: Any | None
    # Server policy (ServerConfig): how much one request may ask for.
    max_prompts_per_request: int = 64
    max_sub_requests: int = 64  # prompts x n

    @classmethod
    def from_orchestrator(cls, orch: Any, config: Any | None = None) -> ModelLimits:
        """`config` (a ServerConfig) adds the server's per-request caps."""
        caps = {} if config is None else dict(
            max_prompts_per_request=config.max_prompts_per_request,
            max_sub_requests=config.max_sub_requests)
        return cls(
            vocab_size=int(orch.vocab_size),
            max_prefill_length=int(getattr(orch, "max_prompt_length", orch.max_prefill_length)),
            max_seq_len=int(orch.max_seq_len),
            bos_id=orch.bos_id,
            eos_ids=tuple(orch.eos_ids),
            top_logprobs=int(getattr(orch, "top_logprobs", 0) or 0),
            tokenizer=orch.tokenizer,
            **caps,
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def encode_text(limits: ModelLimits, text: Any, field: str, *,
                add_bos: bool | None) -> list[int]:
    """Tokenizes `text`. add_bos None: the tokenizer's default (tokenizer_config's
    add_bos_token; True when it has no opinion, as `jetserve generate`)."""
    if not isinstance(text, str):
        raise InvalidArgument(field, f"{field} must be a string, got {type(text).__name__}")
    if text == "":
        raise InvalidArgument(field, f"{field} is empty; give at least one character")
    tok = limits.tokenizer
    if tok is None:
        raise InvalidArgument(field, f"{field}: this model has no tokenizer; send token ids")
    if add_bos is None:
        add_bos = bool(getattr(tok, "add_bos_default", True))
    ids = list(tok.encode(text, add_bos=False))
    if add_bos and limits.bos_id is not None:
        ids = [limits.bos_id] + ids
    return ids


def check_token_ids(limits: ModelLimits, ids: Any, field: str) -> list[int]:
    """A non-empty list of ids inside the vocabulary."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidArgument(field, f"{field} must be a list of token ids")
    if not ids:
        raise InvalidArgument(field, f"{field} is empty; give at least one token id")
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise InvalidArgument(field, f"{field}[{i}] must be an integer token id, got {t!r}")
        if not 0 <= t < limits.vocab_size:
            raise InvalidArgument(
                field, f"{field}[{i}] = {t} is outside the vocabulary [0, {limits.vocab_size})")
    return [int(t) for t in ids]


def check_prompt_length(limits: ModelLimits, ids: Sequence[int], field: str) -> None:
    if not ids:
        raise InvalidArgument(field, f"{field} is empty")
    cap = min(limits.max_prefill_length, limits.max_seq_len - 1)
    if len(ids) > cap:
        raise InvalidArgument(
            field, f"{field} has {len(ids)} tokens; this server accepts at most {cap} "
                   f"(max_prefill_length {limits.max_prefill_length}, "
                   f"max_seq_len {limits.max_seq_len})")


def check_max_tokens(limits: ModelLimits, n: Any, prompt_len: int, field: str = "max_tokens",
                     *, allow_zero: bool = False) -> int:
    """1 <= n (0 when allowed) and prompt + n within max_seq_len."""
    if not _is_int(n):
        raise InvalidArgument(field, f"{field} must be an integer, got {n!r}")
    lo = 0 if allow_zero else 1
    if n < lo:
        raise InvalidArgument(field, f"{field} must be >= {lo}, got {n}")
    room = limits.max_seq_len - prompt_len
    if n > room:
        raise InvalidArgument(
            field, f"{field} = {n} is too large: the prompt has {prompt_len} tokens and "
                   f"max_seq_len is {limits.max_seq_len}, so at most {room} can be generated")
    return int(n)


def _number(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgument(field, f"{field} must be a number, got {v!r}")
    if not math.isfinite(v):
        raise InvalidArgument(field, f"{field} must be a finite number, got {v!r}")
    return float(v)


_FIELD_IN_MESSAGE = re.compile(r"^(\w+)")


def sampling_params(*, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
                    min_p: Any = 0.0, repetition_penalty: Any = 1.0,
                    frequency_penalty: Any = 0.0, presence_penalty: Any = 0.0,
                    seed: Any = None, names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from wire values; `names` maps our field names to the wire's."""
    names = names or {}
    name = lambda f: names.get(f, f)
    floats = dict(temperature=temperature, top_p=top_p, min_p=min_p,
                  repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                  presence_penalty=presence_penalty)
    values: dict[str, Any] = {k: _number(v, name(k)) for k, v in floats.items()}
    if not _is_int(top_k):
        raise InvalidArgument(name("top_k"), f"{name('top_k')} must be an integer, got {top_k!r}")
    values["top_k"] = max(int(top_k), 0) if top_k == -1 else int(top_k)  # -1: off, as vLLM
    if seed is not None:
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise InvalidArgument(name("seed"),
                                  f"{name('seed')} must be an integer in [0, {MAX_SEED}], "
                                  f"got {seed!r}")
        values["seed"] = int(seed)
    try:
        return SamplingParams(**values)
    except ValueError as e:
        m = _FIELD_IN_MESSAGE.match(str(e))
        field = name(m.group(1)) if m else "sampling"
        raise InvalidArgument(field, str(e).replace(m.group(1), field, 1) if m
                              else str(e)) from None


def sample_seed(sampling: SamplingParams, index: int) -> SamplingParams:
    """The i-th of n samples: seeded requests get distinct, reproducible seeds."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % (MAX_SEED + 1))


def check_logprobs(limits: ModelLimits, n: Any, field: str = "logprobs") -> int:
    if not _is_int(n) or n < 0:
        raise InvalidArgument(field, f"{field} must be an integer >= 0, got {n!r}")
    if n > limits.top_logprobs:
        raise InvalidArgument(
            field, f"{field} = {n} is more than this server returns ({limits.top_logprobs})")
    return int(n)


def check_stop(stop: Any, field: str = "stop") -> tuple[str, ...]:
    """None, one string or a list of strings -> a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise InvalidArgument(field, f"{field} must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidArgument(field, f"{field} has {len(items)} strings; at most "
                                     f"{MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(items):
        if not isinstance(s, str) or s == "":
            raise InvalidArgument(field, f"{field}[{i}] must be a non-empty string, got {s!r}")
    return tuple(items)


def check_samples(n: Any, field: str = "n") -> int:
    if not _is_int(n) or not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgument(field, f"{field} must be an integer in [1, {MAX_SAMPLES}], "
                                     f"got {n!r}")
    return int(n)


def check_sub_requests(limits: ModelLimits, prompts: int, n: int, *,
                       prompt_field: str = "prompt", n_field: str = "n") -> None:
    """One request's prompts and prompts x n within the server's caps; called before
    anything is tokenized, so an oversized request costs nothing."""
    if prompts > limits.max_prompts_per_request:
        raise InvalidArgument(prompt_field, f"{prompt_field} has {prompts} prompts; this "
                              f"server accepts at most {limits.max_prompts_per_request} "
                              "per request")
    if prompts * n > limits.max_sub_requests:
        made = f"{prompts} prompts x {n_field} {n}" if prompts > 1 else f"{n_field} {n}"
        raise InvalidArgument(n_field, f"{made} make {prompts * n} sub-requests; this server "
                              f"runs at most {limits.max_sub_requests} per request")


def check_stop_token_ids(limits: ModelLimits, ids: Any,
                         field: str = "stop_token_ids") -> tuple[int, ...]:
    if ids is None or (isinstance(ids, (list, tuple)) and not ids):
        return ()
    return tuple(check_token_ids(limits, ids, field))

"""Checks shared by the gRPC and HTTP front ends: from wire values to a valid Request.

Every check raises `InvalidArgument` naming the wire field, the value and what was
expected, so both servers turn it into INVALID_ARGUMENT / HTTP 400 the same way. Plain
functions of a `ModelLimits` snapshot; no state, safe from any thread.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from engines import SamplingParams

# jax.random.key folds a seed into 32 bits; larger seeds would silently collide.
MAX_SEED = 2**32 - 1
MAX_STOP_STRINGS = 16
MAX_SAMPLES = 16
# Stop strings are held and matched on every generated token; real ones are short.
MAX_STOP_LENGTH = 1000
# top_k travels as int32 to the device (and uint32 between processes).
MAX_TOP_K = 2**31 - 1
# JSON nesting a request may use; real requests need 4 or 5 levels. Python's json
# parser recurses per level, so a deep body would end in a RecursionError.
MAX_JSON_DEPTH = 64
# Longest rendering of a client's value in an error message.
SHOW_LIMIT = 200


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


# ---- edge checks: plain functions of (value, field name), shared with jetserve.batch ----

_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxtuple, _SHOW.maxdict = 3, 8, 8, 8
_SHOW.maxstring = _SHOW.maxother = _SHOW.maxlong = SHOW_LIMIT


def show(value: Any, limit: int = SHOW_LIMIT) -> str:
    """`value` for an error message: a repr of at most about `limit` characters, so a
    5 MB bad value does not come back as a 5 MB error. Lone surrogates come out escaped
    (repr escapes what is not printable), so the message itself always encodes."""
    try:
        text = _SHOW.repr(value)
    except ValueError:  # an integer with more digits than str() converts
        return f"<an integer of {value.bit_length():,} bits>"
    except RecursionError:
        return f"<a {type(value).__name__} nested too deeply to show>"
    if len(text) > limit:
        text = text[:limit] + "..."
    if isinstance(value, str) and len(value) > _SHOW.maxstring:
        text += f" ({len(value):,} characters)"
    elif isinstance(value, (list, tuple, dict)) and len(value) > _SHOW.maxlist:
        text += f" ({len(value):,} items)"
    return text


def text_problem(s: str) -> str | None:
    """Why `s` cannot be tokenized or written as UTF-8, or None when it can. JSON can carry
    a lone surrogate ("\\ud800"), which Python keeps in a str but no tokenizer or encoder
    accepts."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"a lone surrogate U+{ord(s[e.start]):04X} at character {e.start} "
                "(text must be valid Unicode; a JSON \\ud800-\\udfff escape must be half "
                "of a pair)")
    return None


def check_text(value: Any, field: str) -> str:
    """A string that encodes as UTF-8 (see text_problem)."""
    if not isinstance(value, str):
        raise InvalidArgument(field, f"{field} must be a string, got {show(value)}")
    why = text_problem(value)
    if why:
        raise InvalidArgument(field, f"{field} is not valid Unicode: it contains {why}")
    return value


def check_int(value: Any, field: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi] (not a bool): what the engine's arrays can hold."""
    if not _is_int(value):
        raise InvalidArgument(field, f"{field} must be an integer, got {show(value)}")
    if not lo <= value <= hi:
        raise InvalidArgument(field, f"{field} must be an integer in [{lo}, {hi}], "
                                     f"got {show(value)}")
    return int(value)


# Every byte that is not a bracket or a quote, to delete in one pass.
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'[]{}"')


def check_json_depth(raw: bytes | str, field: str = "body",
                     limit: int = MAX_JSON_DEPTH) -> None:
    """Refuses JSON nested deeper than `limit` before a recursive parser sees it.

    Brackets inside strings do not count. Linear in the size and vectorized: escapes
    are dropped, then all but brackets and quotes; a bracket after an odd number of
    quotes is inside a string; the depth is a running sum over the others. Free when
    the text has few brackets at all."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:
        return
    # An escaped backslash first, so that in '\\"' the quote still ends the string.
    data = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    marks = np.frombuffer(data, np.uint8)
    quote = marks == ord('"')
    outside = ((np.cumsum(quote, dtype=np.int32) & 1) == 0) & ~quote  # even quotes before
    steps = np.where((marks == ord("[")) | (marks == ord("{")), np.int32(1), np.int32(-1))
    steps = steps[outside]
    if steps.size and int(np.cumsum(steps, dtype=np.int32).max()) > limit:
        raise InvalidArgument(field, f"{field} is JSON nested more than {limit} levels "
                                     "deep; flatten it")


def encode_text(limits: ModelLimits, text: Any, field: str, *,
                add_bos: bool | None) -> list[int]:
    """Tokenizes `text`. add_bos None: the tokenizer's default (tokenizer_config's
    add_bos_token; True when it has no opinion, as `jetserve generate`)."""
    if not isinstance(text, str):
        raise InvalidArgument(field, f"{field} must be a string, got {type(text).__name__}")
    check_text(text, field)  # sentencepiece fails deep inside on a lone surrogate
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
            raise InvalidArgument(field, f"{field}[{i}] must be an integer token id, got {show(t)}")
        if not 0 <= t < limits.vocab_size:
            raise InvalidArgument(
                field, f"{field}[{i}] = {show(t)} is outside the vocabulary "
                       f"[0, {limits.vocab_size})")
    return [int(t) for t in ids]


def check_prompt_length(limits: ModelLimits, ids: Sequence[int], field: str) -> None:
    if not ids:
        raise InvalidArgument(field, f"{field} is empty")
    cap = min(limits.max_prefill_length, limits.max_seq_len - 1)
    if len(ids) > cap:
        raise InvalidArgument(field, f"{field} has {len(ids)} tokens; {prompt_limit(limits)}")


def prompt_limit(limits: ModelLimits) -> str:
    """What caps a prompt here and the server flag that raises it."""
    cap = min(limits.max_prefill_length, limits.max_seq_len - 1)
    if cap == limits.max_seq_len - 1:
        return (f"the longest prompt is {cap} tokens (max_seq_len {limits.max_seq_len} less "
                f"one token to generate; --max-seq-len raises it)")
    return (f"the longest prompt is {cap} tokens (max_prefill_length {cap}; "
            f"--max-prefill-length raises it)")


def check_max_tokens(limits: ModelLimits, n: Any, prompt_len: int, field: str = "max_tokens",
                     *, allow_zero: bool = False) -> int:
    """1 <= n (0 when allowed) and prompt + n within max_seq_len."""
    if not _is_int(n):
        raise InvalidArgument(field, f"{field} must be an integer, got {show(n)}")
    lo = 0 if allow_zero else 1
    if n < lo:
        raise InvalidArgument(field, f"{field} must be >= {lo}, got {show(n)}")
    room = limits.max_seq_len - prompt_len
    if n > room:
        raise InvalidArgument(
            field, f"{field} = {show(n)} is too large: the prompt has {prompt_len} tokens and "
                   f"max_seq_len is {limits.max_seq_len}, so at most {room} can be generated")
    return int(n)


def _number(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgument(field, f"{field} must be a number, got {show(v)}")
    if not math.isfinite(v):
        raise InvalidArgument(field, f"{field} must be a finite number, got {show(v)}")
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
    top_k = check_int(top_k, name("top_k"), -1, MAX_TOP_K)
    values["top_k"] = max(top_k, 0)  # -1: off, as vLLM
    if seed is not None:
        values["seed"] = check_int(seed, name("seed"), 0, MAX_SEED)
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
        raise InvalidArgument(field, f"{field} must be an integer >= 0, got {show(n)}")
    if n > limits.top_logprobs:
        raise InvalidArgument(
            field, f"{field} = {show(n)} is more than this server returns "
                   f"({limits.top_logprobs})")
    return int(n)


def check_stop(stop: Any, field: str = "stop") -> tuple[str, ...]:
    """None, one string or a list of strings -> a tuple of non-empty strings, at most
    MAX_STOP_STRINGS of at most MAX_STOP_LENGTH characters (each is held and matched on
    every generated token)."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise InvalidArgument(field, f"{field} must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidArgument(field, f"{field} has {len(items)} strings; at most "
                                     f"{MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(items):
        where = field if isinstance(stop, str) else f"{field}[{i}]"
        if not isinstance(s, str) or s == "":
            raise InvalidArgument(where, f"{where} must be a non-empty string, got {show(s)}")
        check_text(s, where)
        if len(s) > MAX_STOP_LENGTH:
            raise InvalidArgument(where, f"{where} has {len(s):,} characters; a stop string "
                                         f"may have at most {MAX_STOP_LENGTH}")
    return tuple(items)


def check_samples(n: Any, field: str = "n") -> int:
    if not _is_int(n) or not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgument(field, f"{field} must be an integer in [1, {MAX_SAMPLES}], "
                                     f"got {show(n)}")
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

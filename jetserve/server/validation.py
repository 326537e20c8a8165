"""Checks shared by the gRPC and HTTP front ends: from wire values to a valid Request.

Every check raises `InvalidArgument` naming the wire field, the value and what was
expected, so both servers turn it into INVALID_ARGUMENT / HTTP 400 the same way. Plain
functions of a `ModelLimits` snapshot; no state, safe from any thread. The checks that
depend on the served model live in `jetserve.request` (re-exported here), where
`Orchestrator.submit` runs them too; this module adds what only the wire form needs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from engines import SamplingParams
from engines.sampling import MAX_LOGIT_BIAS
from jetserve.request import (  # noqa: F401  the model checks, named for the wire
    SHOW_LIMIT,
    InvalidArgument,
    ModelLimits,
    check_logprobs,
    check_max_tokens,
    check_prompt_length,
    check_stop_token_ids,
    check_token_ids,
    prompt_limit,
    show,
)

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---- edge checks: plain functions of (value, field name), shared with jetserve.batch ----

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


def _number(v: Any, field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidArgument(field, f"{field} must be a number, got {show(v)}")
    if not math.isfinite(v):
        raise InvalidArgument(field, f"{field} must be a finite number, got {show(v)}")
    return float(v)


_FIELD_IN_MESSAGE = re.compile(r"^(\w+)")
_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def logit_bias_pairs(limits: ModelLimits, bias: Any, field: str = "logit_bias"
                     ) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias ({token id (a string of digits, as JSON keys are, or an int):
    value}) as (id, value) pairs; InvalidArgument naming the field for a key that is no
    id of this vocabulary, a value that is not a number, or too many entries (values out
    of [-100, 100] are refused by SamplingParams, under the same field)."""
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise InvalidArgument(field, f"{field} must be an object mapping token ids to "
                                     f"numbers, got {show(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(field, f"{field} may hold at most {MAX_LOGIT_BIAS} tokens, "
                                     f"got {len(bias)}")
    pairs = []
    for key, value in bias.items():
        tok = int(key) if (_is_int(key) or isinstance(key, str) and _TOKEN_ID.fullmatch(key)) \
            else None
        if tok is None or not 0 <= tok < limits.vocab_size:
            raise InvalidArgument(field, f"{field}: key {show(key)} is not a token id of this "
                                         f"model (0..{limits.vocab_size - 1})")
        pairs.append((tok, _number(value, f"{field}[{key}]")))
    return tuple(pairs)


def sampling_params(*, temperature: Any = 0.0, top_k: Any = 0, top_p: Any = 1.0,
                    min_p: Any = 0.0, repetition_penalty: Any = 1.0,
                    frequency_penalty: Any = 0.0, presence_penalty: Any = 0.0,
                    seed: Any = None, logit_bias: tuple[tuple[int, float], ...] = (),
                    names: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from wire values (logit_bias as `logit_bias_pairs` gives it);
    `names` maps our field names to the wire's."""
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
    values["logit_bias"] = logit_bias
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

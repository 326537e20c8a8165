"""What a caller asks the orchestrator for, what the served model accepts, and the
chunks of the answer.

`Request` is immutable and validated on construction (a `ValueError` names the field):
types, signs, request-only rules. What depends on the served model (the vocabulary, the
longest prompt, how many log-probs it returns, whether it scores prompts, whether it has
a tokenizer) is `check_request` against a `ModelLimits` snapshot, which
`Orchestrator.submit` runs on every request; the servers and the batch reader call the
same checks while parsing, with the names their wire form uses, so an error names the
field the client sent. Workers and engines trust the request. `Delta` is one chunk of a
request's stream; the last one carries `finish_reason`.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from engines import SamplingParams
from jetserve.generation_config import GenerationDefaults
from jetserve.structured import Constraint

FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "error")
MAX_CLIENT_LENGTH = 256  # a client id names a key hash or an address, never more


class Overloaded(RuntimeError):
    """Admission is full (or the orchestrator is not accepting): retry later.

    Servers map it to gRPC RESOURCE_EXHAUSTED / HTTP 429.
    """


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_tuple(name: str, v, *, allow_empty: bool) -> tuple[int, ...]:
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"{name} must be a sequence of token ids, got {type(v).__name__}")
    out = tuple(v)
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty; give at least one token id")
    for i, t in enumerate(out):
        if not _is_int(t) or t < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative integer, got {t!r}")
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation (or scoring) request, already tokenized by the caller.

    Args:
      prompt_ids: the prompt's token ids (the caller adds BOS when it wants one).
      sampling: temperature, top-k/p, penalties, seed; greedy by default.
      max_tokens: tokens to generate, >= 1 (0 only with prompt_logprobs: score only).
      stop_token_ids: ids that end the request, besides the engine's EOS ids.
      stop_strings: strings that end the request; never part of the streamed text.
      ignore_eos: keep going past the engine's EOS ids (stop_token_ids still stop).
      logprobs: None, or n >= 0: each token's log-prob plus its top-n alternatives.
      prompt_logprobs: also return the log-prob of each prompt token (echo / scoring).
      deadline: a `time.monotonic()` value; the request ends with "deadline" after it.
      request_id: unique while in flight; a random hex id by default.
      client: who asked (the servers set an API key's hash or the peer's address); the
        admission queue serves clients in turn and bounds each one's share. Never seen by
        the engine. "" for a caller that does not say (batch jobs, `generate`).
      constraint: None, or what the generated text must match (structured output).
      lora_adapter: None (the base model), or the name of a LoRA adapter the engine holds.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False
    deadline: float | None = None
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    client: str = ""
    constraint: Constraint | None = None
    lora_adapter: str | None = None

    def __post_init__(self):
        # Lists are accepted for convenience and frozen into tuples.
        set_ = lambda name, v: object.__setattr__(self, name, v)
        set_("prompt_ids", _int_tuple("prompt_ids", self.prompt_ids, allow_empty=False))
        set_("stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids,
                                          allow_empty=True))
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(
                f"sampling must be an engines.SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.prompt_logprobs, bool):
            raise ValueError(f"prompt_logprobs must be a bool, got {self.prompt_logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        lowest = 0 if self.prompt_logprobs else 1
        if not _is_int(self.max_tokens) or self.max_tokens < lowest:
            hint = "" if self.prompt_logprobs else " (0 is allowed only with prompt_logprobs)"
            raise ValueError(f"max_tokens must be an integer >= {lowest}{hint}, "
                             f"got {self.max_tokens!r}")
        if isinstance(self.stop_strings, str):
            raise ValueError("stop_strings must be a sequence of strings, not one string")
        set_("stop_strings", tuple(self.stop_strings))
        for i, s in enumerate(self.stop_strings):
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop_strings[{i}] must be a non-empty string, got {s!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.deadline is not None and (
            not isinstance(self.deadline, (int, float)) or isinstance(self.deadline, bool)
            or not math.isfinite(self.deadline)
        ):
            raise ValueError(f"deadline must be a time.monotonic() value, got {self.deadline!r}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.client, str):
            raise ValueError(f"client must be a string, got {type(self.client).__name__}")
        if len(self.client) > MAX_CLIENT_LENGTH:
            raise ValueError(f"client is {len(self.client)} characters long; at most "
                             f"{MAX_CLIENT_LENGTH}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise ValueError("constraint must be a jetserve.structured.Constraint, got "
                             f"{type(self.constraint).__name__}")
        if self.lora_adapter is not None:
            if not isinstance(self.lora_adapter, str) or not self.lora_adapter:
                raise ValueError(f"lora_adapter must be None or a non-empty adapter name, "
                                 f"got {self.lora_adapter!r}")

    def prefill_kwargs(self) -> dict:
        """What engine.prefill takes beyond the prompt: the adapter, when one is named."""
        return {} if self.lora_adapter is None else {"adapter": self.lora_adapter}

    def cache_key(self, model_key: str) -> str:
        """The prefix cache's key for this request: a prompt's KV differs by adapter."""
        return adapter_cache_key(model_key, self.lora_adapter)


def adapters_kwargs(adapters: Sequence[str | None]) -> dict:
    """What engine.prefill_rows takes beyond the prompts: each prompt's LoRA adapter
    (None: the base model), when any names one; {} for the base model alone (engines
    without adapters take none)."""
    return {} if all(a is None for a in adapters) else {"adapters": list(adapters)}


def adapter_cache_key(model_key: str, adapter: str | None) -> str:
    """The prefix cache's key of prompts run through LoRA adapter `adapter` (None: the
    base model's, `model_key` itself)."""
    return model_key if adapter is None else f"{model_key}|lora:{adapter}"


@dataclasses.dataclass
class Delta:
    """One chunk of a request's stream (one per generated token, plus a bare final one
    when a request ends without a token: cancelled, deadline, error, score-only)."""

    token_ids: list[int]  # new tokens; the EOS / stop token id included when it ends the request
    text: str  # new text: UTF-8 safe; stop strings and EOS are never emitted
    logprobs: list[float] | None = None  # one per token in token_ids, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None  # set on the last delta (see FINISH_REASONS)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    prompt_logprobs: list[float | None] | None = None  # first delta only, when asked
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


# ---- what the served model accepts -------------------------------------------------

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
    scores_prompts: bool = True  # every prefill engine returns prompt log-probs
    # Server policy (ServerConfig): how much one request may ask for.
    max_prompts_per_request: int = 64
    max_sub_requests: int = 64  # prompts x n
    # The model's generation_config.json: defaults of the fields a request leaves unset.
    generation: GenerationDefaults = GenerationDefaults()

    @classmethod
    def from_orchestrator(cls, orch: Any, config: Any | None = None, *,
                          generation: GenerationDefaults | None = None) -> ModelLimits:
        """`config` (a ServerConfig) adds the server's per-request caps and the model's
        default sampling; `generation`: those defaults, for callers with no ServerConfig."""
        server = {} if config is None else dict(
            max_prompts_per_request=config.max_prompts_per_request,
            max_sub_requests=config.max_sub_requests,
            generation=config.generation_defaults)
        if generation is not None:
            server["generation"] = generation
        return cls(
            vocab_size=int(orch.vocab_size),
            max_prefill_length=int(getattr(orch, "max_prompt_length", orch.max_prefill_length)),
            max_seq_len=int(orch.max_seq_len),
            bos_id=orch.bos_id,
            eos_ids=tuple(orch.eos_ids),
            top_logprobs=int(getattr(orch, "top_logprobs", 0) or 0),
            tokenizer=orch.tokenizer,
            scores_prompts=all(hasattr(e, "prompt_logprobs")
                               for e in getattr(orch, "prefill_engines", ())),
            **server,
        )


def check_request(limits: ModelLimits, r: Request,
                  names: Mapping[str, str] | None = None) -> None:
    """InvalidArgument unless `r` fits the served model; `names` maps a Request field to
    the name the caller knows it by."""
    name = lambda f: (names or {}).get(f, f)
    check_token_ids(limits, r.prompt_ids, name("prompt_ids"))
    # A score-only request (max_tokens 0) needs no room for a generated token.
    check_prompt_fits(len(r.prompt_ids), limits.max_prefill_length, limits.max_seq_len,
                      name("prompt_ids"), room=int(r.max_tokens > 0))
    check_stop_token_ids(limits, r.stop_token_ids, name("stop_token_ids"))
    if r.logprobs is not None:
        check_logprobs(limits, r.logprobs, name("logprobs"))
    if r.prompt_logprobs and not limits.scores_prompts:
        raise InvalidArgument(name("prompt_logprobs"), f"{name('prompt_logprobs')}: this "
                              "engine cannot score prompts")
    for tok, _ in r.sampling.logit_bias:
        if tok >= limits.vocab_size:
            raise InvalidArgument(name("logit_bias"), f"{name('logit_bias')}: token id {tok} "
                                  f"is not in the vocabulary (ids 0..{limits.vocab_size - 1})")
    if r.stop_strings and limits.tokenizer is None:
        raise InvalidArgument(name("stop_strings"), f"{name('stop_strings')}: this model has "
                              "no tokenizer, so stop strings cannot be matched; use "
                              "stop_token_ids")


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
    check_prompt_fits(len(ids), limits.max_prefill_length, limits.max_seq_len, field)


def check_prompt_fits(n: int, longest: int, max_seq_len: int, field: str, *,
                      room: int = 1) -> None:
    """InvalidArgument unless a prompt of n tokens fits: at most `longest` (one prefill,
    or max_seq_len - 1 with chunked prefill) and `room` tokens to generate."""
    cap = min(longest, max_seq_len - room)
    if n > cap:
        raise InvalidArgument(field, f"{field} has {n} tokens; "
                                     f"{prompt_limit(longest, max_seq_len)}")


def prompt_limit(longest: int, max_seq_len: int) -> str:
    """What caps a prompt here and the server flag that raises it."""
    cap = min(longest, max_seq_len - 1)
    if cap == max_seq_len - 1:
        return (f"the longest prompt is {cap} tokens (max_seq_len - 1 = {cap}, room for one "
                "token to generate; --max-seq-len raises it)")
    return (f"the longest prompt is {cap} tokens (max_prefill_length={cap}; "
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


def check_logprobs(limits: ModelLimits, n: Any, field: str = "logprobs") -> int:
    if not _is_int(n) or n < 0:
        raise InvalidArgument(field, f"{field} must be an integer >= 0, got {show(n)}")
    if n > limits.top_logprobs:
        raise InvalidArgument(
            field, f"{field} = {show(n)} is more than this server returns "
                   f"({field}={n} asked, top_logprobs={limits.top_logprobs})")
    return int(n)


def check_stop_token_ids(limits: ModelLimits, ids: Any,
                         field: str = "stop_token_ids") -> tuple[int, ...]:
    if ids is None or (isinstance(ids, (list, tuple)) and not ids):
        return ()
    return tuple(check_token_ids(limits, ids, field))

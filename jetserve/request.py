"""What a caller asks the orchestrator for, and the chunks of its answer.

`Request` is immutable and validated on construction (a `ValueError` names the field).
Checks that depend on the served model (vocabulary, prompt length, log-prob count) happen
in `Orchestrator.submit`. `Delta` is one chunk of a request's stream; the last one carries
`finish_reason`.
"""

from __future__ import annotations

import dataclasses
import math
import uuid

from engines import SamplingParams
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
            if self.prompt_logprobs:  # TODO(#23): score prompts through an adapter
                raise ValueError("prompt_logprobs (echo) is not served through a LoRA "
                                 f"adapter yet (lora_adapter {self.lora_adapter!r})")

    def prefill_kwargs(self) -> dict:
        """What engine.prefill takes beyond the prompt: the adapter, when one is named."""
        return {} if self.lora_adapter is None else {"adapter": self.lora_adapter}

    def cache_key(self, model_key: str) -> str:
        """The prefix cache's key for this request: a prompt's KV differs by adapter."""
        return model_key if self.lora_adapter is None else f"{model_key}|lora:{self.lora_adapter}"


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

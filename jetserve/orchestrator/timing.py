"""Per-request timing and the events the orchestrator publishes to listeners.

Times are `time.monotonic()` seconds. A request's timing is written by the stage that
holds it (submit, prefill thread, detokenize thread), one after another, so it needs no
lock; read it after the request ended, or accept a snapshot in flux.

Listeners (`Orchestrator.add_listener`) are called on the orchestrator's threads and must
return quickly; an exception in a listener is logged and ignored. The metrics server
subscribes here, so the orchestrator never imports prometheus.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestTiming:
    arrival: float  # submit() accepted it
    prefill_start: float | None = None
    prefill_end: float | None = None  # first token on the host
    first_token: float | None = None  # first token handed to the stream
    token_times: list[float] = dataclasses.field(default_factory=list)  # one per token
    end: float | None = None  # final delta handed to the stream
    # Speculative decoding (generate thread): draft tokens proposed for this request, and
    # how many of them the target model accepted.
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def queue_time(self) -> float | None:
        return None if self.prefill_start is None else self.prefill_start - self.arrival

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.arrival

    def inter_token(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]


@dataclasses.dataclass(frozen=True)
class RequestFinished:
    request_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timing: RequestTiming
    lora_adapter: str | None = None  # the request's LoRA adapter (None: the base model)


@dataclasses.dataclass(frozen=True)
class StepDone:
    """One generate step consumed on the host. step_time: since the previous step's
    results arrived (or since dispatch, after an idle gap)."""

    engine: int  # index into generate_engines
    batch_size: int  # slots occupied in that step
    step_time: float


@dataclasses.dataclass(frozen=True)
class PrefillDone:
    engine: int  # index into prefill_engines
    prompt_tokens: int
    seconds: float


Event = RequestFinished | StepDone | PrefillDone


class Listeners:
    """A thread-safe list of callbacks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._callbacks: tuple[Callable[[Event], None], ...] = ()

    def add(self, callback: Callable[[Event], None]) -> None:
        with self._lock:
            self._callbacks = self._callbacks + (callback,)

    def remove(self, callback: Callable[[Event], None]) -> None:
        with self._lock:
            self._callbacks = tuple(c for c in self._callbacks if c is not callback)

    def __bool__(self) -> bool:
        return bool(self._callbacks)

    def emit(self, event: Event) -> None:
        for cb in self._callbacks:
            try:
                cb(event)
            except Exception:  # a broken listener must not stop serving
                log.exception("orchestrator listener %r failed on %r", cb, event)

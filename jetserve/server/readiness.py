"""Whether the servers take requests yet: listening but warming up (compiling), then ready.

Draining (SIGTERM): `set_draining()` turns health NOT_SERVING / 503 for good, while the
servers may still take requests for `--drain-notice` seconds (routers polling health move
their traffic first), then stop accepting (jetserve/server/runner.py).

`jetserve serve` starts both servers before it compiles, so probes see the process up and
why it is not ready: gRPC health reports NOT_SERVING and HTTP /health answers 503 with
what is still compiling, while Decode and completions are refused (UNAVAILABLE / 503)
rather than queued behind minutes of compiling. When the warm-up ends, `Servers.ready()`
turns health SERVING / 200.

Concurrency: the warm-up thread writes, both server loops read; every access holds the
lock, and what readers get is a copy.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence


class Readiness:
    """Warming up (with the steps still to compile) or ready; ready by default."""

    def __init__(self, *, warming: bool = False):
        self._lock = threading.Lock()
        self._ready = not warming
        self._draining = False
        self._left: list[str] = []
        self._done = 0

    @property
    def is_ready(self) -> bool:
        """Warmed up (requests are taken, also while draining)."""
        with self._lock:
            return self._ready

    @property
    def is_draining(self) -> bool:
        with self._lock:
            return self._draining

    @property
    def healthy(self) -> bool:
        """What health reports: ready and not draining."""
        with self._lock:
            return self._ready and not self._draining

    def set_draining(self) -> None:
        with self._lock:
            self._draining = True

    def plan(self, steps: Sequence[str]) -> None:
        """The warm-up's steps, in order ("prompt length 16", ...): all still to do."""
        with self._lock:
            self._left, self._done = list(steps), 0

    def step_done(self) -> None:
        with self._lock:
            if self._left:
                self._left.pop(0)
                self._done += 1

    def set_ready(self) -> None:
        with self._lock:
            self._ready, self._left = True, []

    def warming_body(self) -> dict:
        """/health's 503 body while warming up: what is compiling, and how far it got."""
        with self._lock:
            return {"status": "warming up", "compiling": list(self._left),
                    "done": self._done, "total": self._done + len(self._left)}

    def refusal(self) -> str:
        """The message a request refused while warming up gets."""
        with self._lock:
            left = len(self._left)
        what = f"{left} warm-up step{'s' if left != 1 else ''} left" if left else "starting"
        return (f"server warming up (compiling the model's programs; {what}): retry when "
                "health reports SERVING (gRPC grpc.health.v1) or 200 (HTTP /health)")

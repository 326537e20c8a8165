"""The decode role over several processes (`jetserve serve --role decode --coordinator
...`): one generate engine whose mesh spans the devices of every process.

Process 0 is the decode side of one process (decode_orchestrator.py: the front, the
remote prefill threads, the transfer stage pulling prefixes onto one device of its own,
the generate thread). Its generate thread calls the engine through `LockStepGenerate`,
which first broadcasts each call as a turn (prefill_lockstep.exchange_turn) that every
other process replays on its copy of the decode state (`follow`):

  {"op": "spread", address, uuids, leaves, offered}  the next prefix (prefix_spread.py:
                      process 0 offers each process its blocks; all agree it landed)
  {"op": "insert", "slot"}    insert the spread prefix     {"op": "free", "slot"}
  {"op": "generate", "rows"}  one step (over the first rows  {"op": "init"}  fresh state
                              slots; None: all)
  {"op": "move", "src", "dst"}  a running request to a lower slot (GenerateWorker._compact)
  {"op": "idle"}              nothing (process 0 sends one when no call came for
                              `idle_s`, so the others see a stop soon)
  {"op": "stop"}              leave

One thread makes the calls on process 0, in order, and a lock keeps the idle turns
between them, so every process runs the same programs in the same order. A prefix some
process did not receive is dropped by every process (`SpreadFailed`); process 0 sends its
request back to be prefilled again, as after a failed pull. An engine call that fails,
fails on every process alike; the generate thread recovers as in one process. A failed
broadcast (a process went away) ends the lock step: every later call raises, so every
request fails rather than hangs.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from jetserve import distributed
from jetserve.disagg.prefill_lockstep import Broadcast, exchange_turn
from jetserve.disagg.prefix_spread import PrefixSpreader, SpreadFailed
from jetserve.orchestrator.generate_worker import GenerateWorker
from jetserve.orchestrator.live import LiveRequest

log = logging.getLogger("jetserve.disagg")


class LockStepGenerate:
    """Process 0's generate engine: each call broadcast first (see module doc); other
    attributes are the engine's.

    Args:
      engine: the generate engine (over every process's devices).
      spreader: spreads pulled prefixes over the processes.
      broadcast: process 0's array on every process (default:
        distributed.broadcast_from_primary).
      idle_s: the longest the others wait for a turn while process 0 is idle.
    """

    def __init__(self, engine: Any, spreader: PrefixSpreader, *,
                 broadcast: Broadcast | None = None, idle_s: float = 0.25):
        self.engine = engine
        self.spreader = spreader
        self._broadcast = broadcast or distributed.broadcast_from_primary
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._broken: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _send(self, turn: dict, must: bool = True) -> None:
        """Broadcasts `turn`; once the lock step ended, raises (unless not `must`: host
        bookkeeping such as freeing a slot goes on, so requests end cleanly)."""
        if self._broken is not None:
            if not must:
                return
            raise RuntimeError(f"the decode role's lock step ended: {self._broken}")
        try:
            exchange_turn(turn, self._broadcast)
        except Exception as e:
            self._broken = str(e)
            raise
        self._last = time.monotonic()

    def spread(self, prefix: Any) -> Any:
        """The pulled prefix over every process (SpreadFailed when one lacks its part)."""
        with self._lock:
            turn, held = self.spreader.offer(prefix)
            self._send({"op": "spread", **turn})
            got = self.spreader.take(turn, prefix)
            del held  # every process has its blocks now
            return got

    def insert(self, prefix: Any, decode_state: Any, slot: int, **kw: Any) -> Any:
        if kw:
            raise ValueError(f"{', '.join(kw)}: not taken by the decode role over several "
                             "processes")
        with self._lock:
            self._send({"op": "insert", "slot": slot})
            return self.engine.insert(prefix, decode_state, slot)

    def generate(self, params: Any, decode_state: Any, token_mask: Any = None,
                 rows: int | None = None) -> Any:
        if token_mask is not None:
            raise ValueError("token_mask: structured output is not available when several "
                             "processes serve one model (lock-step)")
        with self._lock:
            self._send({"op": "generate", "rows": rows})
            return self.engine.generate(params, decode_state, **_rows(rows))

    def move_slot(self, decode_state: Any, src: int, dst: int) -> Any:
        with self._lock:
            self._send({"op": "move", "src": src, "dst": dst})
            return self.engine.move_slot(decode_state, src, dst)

    def free_slot(self, slot: int) -> None:
        with self._lock:
            self._send({"op": "free", "slot": slot}, must=False)
            self.engine.free_slot(slot)

    def init_decode_state(self) -> Any:
        with self._lock:
            self._send({"op": "init"}, must=False)
            return self.engine.init_decode_state()

    def heartbeat(self, stopping: threading.Event) -> None:
        """Idle turns until `stopping` (a thread of process 0's orchestrator)."""
        while not stopping.wait(self.idle_s / 2):
            with self._lock:
                if self._broken is None and time.monotonic() - self._last >= self.idle_s:
                    try:
                        self._send({"op": "idle"})
                    except Exception:
                        log.exception("decode lock step failed; every call fails from now")

    def close(self) -> None:
        """Tells the others to leave (after process 0's threads ended)."""
        with self._lock:
            if self._broken is None:
                self._send({"op": "stop"})
            self._broken = "stopped"


def follow(engine: Any, params: Any, spreader: PrefixSpreader,
           broadcast: Broadcast | None = None) -> None:
    """Another process's turns until process 0 stops (its main thread)."""
    broadcast = broadcast or distributed.broadcast_from_primary
    state = engine.init_decode_state()
    spread = None
    while True:
        turn = exchange_turn(None, broadcast)
        op = turn["op"]
        if op == "stop":
            return
        try:
            if op == "spread":
                spread = None
                spread = spreader.take(turn)
            elif op == "insert":
                state, spread = engine.insert(spread, state, turn["slot"]), None
            elif op == "generate":
                state, _ = engine.generate(params, state, **_rows(turn.get("rows")))
            elif op == "move":
                state = engine.move_slot(state, turn["src"], turn["dst"])
            elif op == "free":
                engine.free_slot(turn["slot"])
            elif op == "init":
                state = engine.init_decode_state()
        except SpreadFailed:
            pass  # dropped on every process; process 0 prefills the request again
        except Exception:  # the same failure on process 0, which recovers alike
            log.exception("decode lock-step %s failed", op)


def _rows(rows: int | None) -> dict:
    """generate's keyword for a step over the first `rows` slots (none for all)."""
    return {} if rows is None else {"rows": rows}


class DecodeFollower:
    """What `jetserve serve` runs on a decode process other than 0: `run` follows."""

    def __init__(self, engine: Any, params: Any, spreader: PrefixSpreader):
        self.engine, self.params, self.spreader = engine, params, spreader

    def run(self) -> None:
        follow(self.engine, self.params, self.spreader)


def refuse_constraints(requests) -> None:
    """ValueError for a structured-output request (its masks are not broadcast)."""
    for r in requests:
        if getattr(r, "constraint", None) is not None:
            raise ValueError(f"{r.constraint.field}: structured output is not available "
                             "when several processes serve one model (lock-step)")


class SpreadingGenerateWorker(GenerateWorker):
    """Process 0's generate thread: each prefix is spread over the processes before its
    insert; one that some process lacks sends its request back to be prefilled again
    (`max_spread_retries` times, then it ends with the error)."""

    max_spread_retries = 2

    def _admit(self, slot: int, live: LiveRequest, prefix: Any) -> None:
        try:
            prefix = self.engine.spread(prefix)
        except Exception as e:  # SpreadFailed, or the lock step ended
            self._release(slot)
            if live.done:
                return
            if isinstance(e, SpreadFailed) and live.preemptions < self.max_spread_retries:
                log.warning("request %s: %s; prefilling it again", live.request_id, e)
                live.preempted()
                self.resume(live)
            else:
                self.readback.end(live, "error", e)
            return
        super()._admit(slot, live, prefix)

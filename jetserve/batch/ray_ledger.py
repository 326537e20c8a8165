"""What a Ray batch job remembers across engine actors that die: the ledger.

Ray Data hands each block of rows to an engine actor; when the actor's process dies
(killed, out of memory, its host preempted), Ray starts the actor again (a new process,
on another host when its own is gone) and runs the block again. Ray keeps no memory of
the attempt that died, so the engine actors keep it here, in one small actor of the job:

- `begin(block, keys)` at the start of every attempt at a block. The first attempt runs
  the block whole. If an earlier attempt began and never ended, its actor died: the rows
  it had not finished each get a death against them (the block ran them together, so
  any of them may be the cause), and from then on the block runs one row at a time,
  each alone in its engine, so a death names its row.
- `started(block, key)` / `finished(block, rows)`: which row runs alone now, and the
  rows that are done (their output lines and prompt tokens, kept until the block ends,
  so an attempt after a death returns them without running them again).
- A row with `KILL_LIMIT` deaths (one in its block, one alone) is not run again: the
  attempt gets it back as `poisoned`, and the actor writes its error row.
- `end(block)`: the block's rows went to the driver; what was kept for it is dropped.
- `heartbeat(actor, pid, node)`: every engine actor, every `HEARTBEAT_S`; the driver
  counts the actors heard from lately as alive, and the restarts (a new pid for an actor).
- `status()`: those counts, the busy actors, and the time from the first block's start
  to the last block's end (the job without the actors' start).

`Ledger` is plain Python (tested without Ray); `remote_ledger` makes it a Ray actor.
Ray runs one method of an actor at a time, so nothing here needs a lock.
"""

from __future__ import annotations

import dataclasses
import time

KILL_LIMIT = 2  # deaths of its engine actor that make a row an error row
HEARTBEAT_S = 1.0
ALIVE_S = 5.0  # an actor not heard from for this long is not counted alive


@dataclasses.dataclass
class Attempt:
    """What an attempt at a block is told by `begin`."""

    alone: bool  # run the rows one at a time (an earlier attempt died)
    done: dict[str, tuple[str, int]]  # key -> (output line, prompt tokens) of rows
    # finished by earlier attempts
    poisoned: dict[str, int]  # key -> deaths, for rows not to run again


@dataclasses.dataclass
class _Block:
    keys: list[str]
    running: bool = False
    alone: bool = False
    current: str | None = None  # the row running alone now
    done: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    attempts: int = 0


@dataclasses.dataclass
class _Actor:
    pid: int
    node: str
    seen: float
    starts: int = 1
    block: str | None = None  # the block it runs now
    began: float = 0.0  # when it began that block


class Ledger:
    def __init__(self, kill_limit: int = KILL_LIMIT, clock=time.monotonic):
        self._limit = kill_limit
        self._clock = clock
        self._blocks: dict[str, _Block] = {}
        self._deaths: dict[str, int] = {}  # row key -> deaths while it ran
        self._actors: dict[str, _Actor] = {}
        self.retried = 0  # attempts after a death
        self._first_begin: float | None = None
        self._last_end: float | None = None

    def begin(self, block: str, keys: list[str], actor: str | None = None) -> Attempt:
        b = self._blocks.get(block)
        if b is None:
            b = self._blocks[block] = _Block(list(keys))
        elif b.running:  # the attempt before this one died
            self.retried += 1
            dead = [b.current] if b.alone else [k for k in b.keys if k not in b.done]
            for k in dead:
                if k is not None:
                    self._deaths[k] = self._deaths.get(k, 0) + 1
            b.alone, b.current = True, None
        b.running = True
        b.attempts += 1
        if self._first_begin is None:
            self._first_begin = self._clock()
        if actor in self._actors:
            a = self._actors[actor]
            a.block, a.began = block, self._clock()
        poisoned = {k: self._deaths[k] for k in b.keys
                    if k not in b.done and self._deaths.get(k, 0) >= self._limit}
        return Attempt(alone=b.alone, done=dict(b.done), poisoned=poisoned)

    def started(self, block: str, key: str) -> None:
        self._blocks[block].current = key

    def finished(self, block: str, rows: list[tuple[str, str, int]]) -> None:
        """rows: (key, output line, prompt tokens) of rows that finished."""
        b = self._blocks.get(block)
        if b is None or not b.running:
            return
        b.done.update((key, (line, n)) for key, line, n in rows)
        if b.current is not None and b.current in b.done:
            b.current = None

    def end(self, block: str, actor: str | None = None) -> None:
        b = self._blocks[block]
        b.running, b.current, b.done = False, None, {}
        self._last_end = self._clock()
        a = self._actors.get(actor) if actor is not None else None
        if a is not None and a.block == block:
            a.block = None

    def heartbeat(self, actor: str, pid: int, node: str = "") -> None:
        a = self._actors.get(actor)
        now = self._clock()
        if a is None:
            self._actors[actor] = _Actor(pid, node, now)
            return
        if a.pid != pid:  # Ray started the actor again
            a.pid, a.node, a.starts, a.block = pid, node, a.starts + 1, None
        a.seen = now

    def status(self) -> dict:
        """Counts for progress and the summary, and each live actor's pid and block."""
        now = self._clock()
        alive = {k: a for k, a in self._actors.items() if now - a.seen <= ALIVE_S}
        return {
            "actors": len(self._actors),
            "alive": len(alive),
            "restarts": sum(a.starts - 1 for a in self._actors.values()),
            "blocks_retried": self.retried,
            # from the first block's start to the last block's end: the job less the
            # actors' start
            "engines_s": (self._last_end - self._first_begin
                          if self._first_begin is not None and self._last_end else 0.0),
            "busy": [{"actor": k, "pid": a.pid, "node": a.node, "block": a.block,
                      "since": now - a.began} for k, a in alive.items() if a.block],
        }


def remote_ledger(name: str):
    """A Ledger as a Ray actor named `name`, on this (the driver's) node: it lives and
    dies with the job's driver, whatever happens to the hosts of the engines."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(Ledger).options(name=name, num_cpus=0, max_concurrency=1,
                                      scheduling_strategy=here).remote()

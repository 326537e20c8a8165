"""Prefixes between processes with `jax.experimental.transfer`: held on the prefill side,
pulled by the decode side.

`KVSender` (prefill side) registers each prefix with its transfer server under a random
uuid (`await_pull`; over several processes, every process registers its own blocks of the
prefix under one uuid that process 0 drew, see prefix_wire.py) and keeps a reference
until the decode side acknowledges the pull (`ack`) or `hold_s` passes (`expire`): either
way the prefix is freed, so a decode worker that never comes back leaks nothing.

`KVReceiver` (decode side) checks a prefix's description against its own engine first
(prefix_wire.check), pulls it with the sender's layout onto its own devices, regroups its
kv heads (`engine.receive_prefix`) and moves it into `prefix_destination_sharding()`.
A failed pull drops the cached connection, so the next one reconnects.

Concurrency: both are called from several threads (RPC handlers, pull threads); their
tables are guarded by a lock. A pull blocks its calling thread until the bytes landed or
`timeout_s` passed. The transfer's own deadline does not end a pull whose peer hangs
(stopped, not gone), but `connect` and `pull` return at once with arrays that become
ready when the bytes land, so the calling thread polls them and gives up on time
(`PullTimeout`): no thread stays behind. What an abandoned pull leaves is its destination
buffers, held by the runtime until the peer sends them or its connection closes (a peer
that dies errors them at once); the worker is marked down meanwhile, so hangs are not
repeated, and at most one prefix's bytes are held per hung pull.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from typing import Any

import jax
from jax.experimental import transfer

from jetserve.disagg import prefix_wire


def _server(device: jax.Device, host: str):
    return transfer.start_transfer_server(device.client, f"{host}:0", [f"{host}:0"])


class PullTimeout(TimeoutError):
    """A pull whose bytes did not land in time (its peer hangs); nothing waits for it."""


def _wall(seconds: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=seconds)


class KVSender:
    """The prefill side's table of prefixes waiting to be pulled.

    Args:
      engine: the prefill engine (its devices' client serves the pulls; its signature goes
        with each prefix).
      host: the address the transfer server binds and advertises.
      hold_s: how long an unacknowledged prefix is kept.
    """

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", hold_s: float = 60.0):
        if not hold_s > 0:
            raise ValueError(f"hold_s must be > 0 seconds, got {hold_s!r}")
        self.engine = engine
        self.hold_s = hold_s
        me = jax.process_index()
        local = [d for d in engine.mesh.devices.flat if d.process_index == me]
        self._server = _server(local[0], host)
        self.address: str = self._server.address()
        # Every process's transfer server, by process index, when the engine spans several
        # processes (set by the lock-step runner): prefixes are then offered block by block.
        self.sources: list[str] | None = None
        self._held: dict[int, tuple[Any, float]] = {}
        self._lock = threading.Lock()
        self.expired = 0

    def register(self, prefix: Any, receiver_devices: int,
                 uuid: int | None = None) -> tuple[int, dict]:
        """(uuid, description) of `prefix`, now held for one pull (under `uuid` when
        given: the same on every process of a lock-step engine)."""
        if self.sources is None:
            wired = prefix_wire.wire_layout(prefix, receiver_devices)
            meta = prefix_wire.describe(wired, self.engine)
            arrays = prefix_wire.nonempty(jax.tree.leaves(wired))
        else:
            meta = prefix_wire.describe_pieces(prefix, self.engine, self.sources)
            wired = arrays = prefix_wire.local_pieces(prefix)
        uuid = secrets.randbits(63) if uuid is None else uuid
        if arrays:  # a process may own no block (all replicated on another's devices)
            # The server's own rendezvous ends a little after ours, so ours frees it first.
            self._server.await_pull(uuid, arrays, timeout=_wall(self.hold_s + 5))
        with self._lock:
            self._held[uuid] = (wired, time.monotonic() + self.hold_s)
        return uuid, meta

    def ack(self, uuid: int) -> bool:
        """Frees the prefix under `uuid`; False when it was not held (acked or expired)."""
        with self._lock:
            return self._held.pop(uuid, None) is not None

    def expire(self, now: float | None = None) -> int:
        """Frees every prefix held past its time; how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [u for u, (_, end) in self._held.items() if end <= now]
            for u in old:
                del self._held[u]
            self.expired += len(old)
        return len(old)

    def registered(self) -> int:
        with self._lock:
            return len(self._held)


class KVReceiver:
    """The decode side's puller into one engine's prefix layout.

    Args:
      engine: the generate engine the prefixes are inserted into.
      host: the address of this side's transfer server (pulls go out through it).
      timeout_s: the longest one pull may take.
      destination: where pulled prefixes go (default: the engine's prefix layout; the
        decode role over several processes pulls onto one device of process 0).
    """

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", timeout_s: float = 60.0,
                 destination: Any = None):
        self.engine = engine
        self.timeout_s = timeout_s
        if destination is None:
            self.devices = list(engine.mesh.devices.flat)
            self.destination = engine.prefix_destination_sharding()
        else:
            held = set().union(*(s.device_set for s in jax.tree.leaves(destination)))
            self.devices = sorted(held, key=lambda d: d.id)
            self.destination = destination
        self.treedef = jax.tree.structure(self.destination)
        self.receive = getattr(engine, "receive_prefix", lambda prefix: prefix)
        self._server = _server(self.devices[0], host)
        self._conns: dict[str, Any] = {}
        self._lock = threading.Lock()

    def pull(self, address: str, uuid: int, meta: dict, who: str) -> Any:
        """The prefix `who` registered under `uuid` at `address` (or, offered block by
        block, at each of its processes' servers), in this engine's layout
        (PrefixMismatch before any pull when it does not fit)."""
        prefix_wire.check(meta, self.engine, who)
        if "pieces" in meta:
            wanted = {meta["sources"][i]: prefix_wire.piece_specs(meta, i, self.devices[0])
                      for i in sorted({p["source"] for p in meta["pieces"]})}
        else:
            specs = prefix_wire.pull_specs(meta, self.devices)
            wanted = {address: prefix_wire.nonempty(specs)}
        conns = {a: self._connection(a) for a in wanted}
        try:
            deadline = _wall(self.timeout_s)
            pulled = {a: conns[a].pull(uuid, specs, timeout=deadline)
                      for a, specs in wanted.items()}
            wait_ready([x for xs in pulled.values() for x in xs], self.timeout_s,
                       f"no prefix from {who}")
        except Exception:
            with self._lock:  # a peer may be gone: the next pull reconnects
                for a, conn in conns.items():
                    if self._conns.get(a) is conn:
                        del self._conns[a]
            raise
        if "pieces" in meta:
            by_source = {i: pulled[a] for i, a in enumerate(meta["sources"]) if a in pulled}
            leaves = prefix_wire.assemble(meta, by_source, self.devices[0])
        else:
            leaves = prefix_wire.with_empty(specs, pulled[address])
        prefix = jax.tree.unflatten(self.treedef, leaves)
        moved = jax.device_put(self.receive(prefix), self.destination)
        jax.block_until_ready(moved)
        return moved

    def _connection(self, address: str) -> Any:
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self._server.connect(address)
            return conn


def wait_ready(leaves: list[Any], timeout_s: float, what: str,
               first_poll_s: float = 0.0005, longest_poll_s: float = 0.002) -> None:
    """Until every array in `leaves` is ready (raising the error of one that failed);
    PullTimeout naming `what` after timeout_s. Polls, from first_poll_s up to
    longest_poll_s between looks, rather than block in the runtime, which could not be
    abandoned: a pull is seen done at most longest_poll_s late."""
    end = time.monotonic() + timeout_s
    pause = first_poll_s
    waiting = list(leaves)
    while waiting:
        waiting = [x for x in waiting if not x.is_ready()]
        if not waiting:
            break
        if time.monotonic() >= end:
            raise PullTimeout(f"{what} after {timeout_s:g} s")
        time.sleep(pause)
        pause = min(2 * pause, longest_poll_s)
    jax.block_until_ready(leaves)  # ready: raises the error of a failed transfer

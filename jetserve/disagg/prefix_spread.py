"""A pulled prefix, spread from the decode role's process 0 over every process of its
generate engine (`--role decode --coordinator`).

Process 0 pulls each prefix from its prefill worker onto one device of its own (the
transfer stage, pull_worker.py: failures and retries as in one process). To insert it,
the prefix must be one array per leaf over the engine's mesh, whose devices belong to
every process; each process supplies the blocks its own devices hold. So process 0 cuts,
for every other process, the distinct blocks that process's devices hold in the engine's
prefix layout (`blocks_of`: the same list on every process, computed from the layout
and the leaf shapes alone), and offers them from its own transfer server under one id
per process (a registered id serves exactly one pull); each process pulls its blocks,
puts each on the devices that hold it, and builds the global arrays
(`jax.make_array_from_single_device_arrays`). Process 0 does the same from its local
copy, without a pull.

`PrefixSpreader.offer` (process 0) and `.take` (every process) are called inside the same
lock-step turn; `take` ends with an agreement (every process says whether its part
landed, `all_agree`), so either every process has the prefix or none keeps it
(`SpreadFailed` on every process alike).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jetserve.disagg import prefix_wire
from jetserve.disagg.kv_transfer import _server, _wall, wait_ready

log = logging.getLogger("jetserve.disagg")


class SpreadFailed(RuntimeError):
    """Some process did not get its part of a prefix: no process inserts it."""


Block = tuple[tuple[tuple[int, int], ...], list[jax.Device]]


def blocks_of(sharding: jax.sharding.Sharding, shape: tuple[int, ...], process: int
              ) -> list[Block]:
    """([start, stop) per dim, the devices of `process` that hold it) for each distinct
    block of an array of `shape` laid out by `sharding`, in device-id order."""
    out: dict[tuple, list[jax.Device]] = {}
    placed = sorted(sharding.devices_indices_map(tuple(shape)).items(), key=lambda kv: kv[0].id)
    for d, index in placed:
        if d.process_index == process:
            key = tuple(sl.indices(n)[:2] for sl, n in zip(index, shape, strict=True))
            out.setdefault(key, []).append(d)
    return list(out.items())


def _cut(x: jax.Array, key: tuple[tuple[int, int], ...]) -> jax.Array:
    return x[tuple(slice(a, b) for a, b in key)]


def all_agree(ok: bool, name: str, timeout_s: float) -> bool:
    """True on every process when `ok` is true on every one; each process votes under
    `name` (new for each agreement) in jax.distributed's key-value store.

    Why not a collective over the devices: process 0 would enter it while the others
    still pull from its transfer server, and a CPU device busy in a collective may not
    serve the pull (seen: a pull that never landed); votes through the coordinator wait
    on the host only."""
    if jax.process_count() == 1:
        return ok
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    client.key_value_set(f"{name}/{jax.process_index()}", "1" if ok else "0")
    wait_ms = int(timeout_s * 1000)
    return all(client.blocking_key_value_get(f"{name}/{p}", wait_ms) == "1"
               for p in range(jax.process_count()))


def forget_vote(name: str) -> None:
    """Deletes this process's vote under `name` (once every process has read it)."""
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed

        jax_distributed.global_state.client.key_value_delete(f"{name}/{jax.process_index()}")


class PrefixSpreader:
    """Process 0's prefix, block by block, on every process's devices (see module doc).

    Args:
      engine: the generate engine (its prefix layout, `prefix_destination_sharding`).
      host: the address of this process's transfer server.
      timeout_s: the longest one process's pull may take.
      agree: the agreement, (ok, name, timeout_s) -> bool (default: all_agree).
    """

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", timeout_s: float = 60.0,
                 agree: Callable[[bool, str, float], bool] = all_agree):
        self.destination = engine.prefix_destination_sharding()
        self.treedef = jax.tree.structure(self.destination)
        self.shardings = jax.tree.leaves(self.destination)
        self.me = jax.process_index()
        self.processes = jax.process_count()
        local = [d for d in engine.mesh.devices.flat if d.process_index == self.me]
        self.device = min(local, key=lambda d: d.id)
        self.timeout_s = timeout_s
        self.agree = agree
        self._server = _server(self.device, host)
        self.address: str = self._server.address()
        self._conn: tuple[str, Any] | None = None
        self._voted: str | None = None  # the last agreement's name
        self.spread = self.failed = 0

    def local_sharding(self) -> Any:
        """Where process 0's transfer stage puts a pulled prefix: one device of its own."""
        one = SingleDeviceSharding(self.device)
        return jax.tree.map(lambda _: one, self.destination)

    def offer(self, prefix: Any) -> tuple[dict, list]:
        """Process 0: registers every other process's blocks of `prefix` (on this
        process's device); returns the turn that tells them what to pull, and the
        registered blocks, which the caller keeps referenced until `take` returned (the
        transfer server does not keep them alive)."""
        leaves = jax.tree.leaves(prefix)
        uuids = [secrets.randbits(63) for _ in range(self.processes)]
        turn = {"address": self.address, "uuids": uuids, "offered": True,
                "leaves": [[list(x.shape), np.dtype(x.dtype).name] for x in leaves]}
        held = []
        try:
            for p in range(1, self.processes):
                # Empty blocks (a key-only cache's values) are not sent: a pull of an
                # empty array never lands (prefix_wire.nonempty); `_pull` makes them.
                blocks = prefix_wire.nonempty([
                    _cut(x, key) for x, s in zip(leaves, self.shardings, strict=True)
                    for key, _ in blocks_of(s, x.shape, p)])
                held.append(blocks)
                self._server.await_pull(uuids[p], blocks, timeout=_wall(self.timeout_s + 5))
        except Exception as e:  # told to the others in the turn: everyone drops this prefix
            log.warning("offering a prefix to the decode processes failed: %s: %s",
                        type(e).__name__, e)
            turn["offered"] = False
        return turn, held

    def take(self, turn: dict, prefix: Any | None = None) -> Any:
        """Every process: the global prefix of `turn` (process 0 passes its local copy),
        once every process has its part; SpreadFailed on every process otherwise."""
        ok = turn["offered"]
        got = None
        if ok:
            try:
                got = self._place(turn, prefix)
            except Exception as e:  # this process's part did not land: everyone drops it
                log.warning("this process's part of a prefix did not land: %s: %s",
                            type(e).__name__, e)
                ok = False
        if self._voted is not None:  # every process read it: it is in this turn
            forget_vote(self._voted)
        self._voted = f"jetserve/spread/{turn['uuids'][0]}"
        try:
            agreed = self.agree(ok, self._voted, self.timeout_s + 10)
        except Exception as e:  # a process went away: its vote never comes
            log.warning("the decode processes could not agree on a prefix: %s: %s",
                        type(e).__name__, e)
            agreed = False
        if not agreed:
            self.failed += 1
            raise SpreadFailed("a process of the decode role did not receive its part of "
                               "the prefix")
        self.spread += 1
        return got

    def _place(self, turn: dict, prefix: Any | None) -> Any:
        shapes = [tuple(shape) for shape, _ in turn["leaves"]]
        mine = [blocks_of(s, shape, self.me)
                for s, shape in zip(self.shardings, shapes, strict=True)]
        if prefix is not None:
            cut = [[_cut(x, key) for key, _ in blocks]
                   for x, blocks in zip(jax.tree.leaves(prefix), mine, strict=True)]
        else:
            cut = self._pull(turn, shapes, mine)
        out = []
        for s, shape, blocks, pieces in zip(self.shardings, shapes, mine, cut, strict=True):
            shards = [jax.device_put(piece, d)
                      for (_, devices), piece in zip(blocks, pieces, strict=True)
                      for d in devices]
            out.append(jax.make_array_from_single_device_arrays(shape, s, shards))
        return jax.tree.unflatten(self.treedef, out)

    def _pull(self, turn: dict, shapes: list[tuple[int, ...]], mine: list[list[Block]]
              ) -> list[list[jax.Array]]:
        """This process's blocks, pulled from process 0, grouped by leaf."""
        one = SingleDeviceSharding(self.device)
        specs = [[jax.ShapeDtypeStruct(tuple(b - a for a, b in key), np.dtype(dtype),
                                       sharding=one) for key, _ in blocks]
                 for (_, dtype), blocks in zip(turn["leaves"], mine, strict=True)]
        conn = self._connection(turn["address"])
        try:
            sent = prefix_wire.nonempty([s for leaf in specs for s in leaf])
            flat = conn.pull(turn["uuids"][self.me], sent, timeout=_wall(self.timeout_s))
            wait_ready(flat, self.timeout_s, "no prefix blocks from process 0")
        except Exception:
            self._conn = None  # the next pull reconnects
            raise
        it = iter(flat)
        return [prefix_wire.with_empty(leaf, [next(it) for s in leaf if math.prod(s.shape)])
                for leaf in specs]

    def _connection(self, address: str) -> Any:
        if self._conn is None or self._conn[0] != address:
            self._conn = (address, self._server.connect(address))
        return self._conn[1]

"""The decode side's view of its prefill workers (`--prefill-workers HOST:PORT,...`).

`check` runs at start-up: every address must answer `Load` as a ready `--role prefill`
worker of the same model (signature) and limits, else a ValueError names the address.
`pick` gives the least loaded worker that is up: the prefills this process has in flight
on it plus the queue depth it last reported (with each answer, and every second from
`refresh`). A worker whose call fails is marked down for `retry_after_s`, or until it
answers `Load` again (gRPC reconnects to a worker restarted on its address).

Concurrency: called from the remote prefill threads and the pull threads; counts are
guarded by a lock, RPCs run outside it on gRPC's thread-safe channels.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc

from jetserve.disagg import prefix_wire
from protos import prefill_worker_pb2 as pb
from protos import prefill_worker_pb2_grpc as pb_grpc

log = logging.getLogger("jetserve.disagg")


def parse_addresses(text: str) -> list[str]:
    """HOST:PORT,... -> addresses; ValueError naming --prefill-workers on a bad one."""
    out = [a.strip() for a in text.split(",") if a.strip()]
    if not out:
        raise ValueError("--prefill-workers is empty; give HOST:PORT,...")
    for a in out:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--prefill-workers: {a!r} is not HOST:PORT")
    if len(set(out)) != len(out):
        raise ValueError(f"--prefill-workers names an address twice: {text!r}")
    return out


@dataclasses.dataclass(eq=False)
class Worker:
    address: str
    stub: Any
    in_flight: int = 0
    reported: int = 0  # queue depth it last reported
    down_until: float = 0.0
    failures: int = 0


class PrefillWorkers:
    """Stubs of the prefill workers, their load and health.

    Args:
      addresses: HOST:PORT of each worker's gRPC port.
      rpc_timeout_s: the longest one Prefill call may take before the worker counts as
        failed (the request is then retried on another).
      retry_after_s: how long a failed worker is left out.
    """

    def __init__(self, addresses: Sequence[str], *, rpc_timeout_s: float = 120.0,
                 retry_after_s: float = 2.0):
        self.rpc_timeout_s, self.retry_after_s = rpc_timeout_s, retry_after_s
        # A worker that went away is redialled at least every 2 s (gRPC's default backoff
        # grows to minutes), so one restarted on its address is back within a refresh.
        backoff = [("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000)]
        self._channels = [grpc.insecure_channel(a, options=backoff) for a in addresses]
        self.workers = [Worker(a, pb_grpc.PrefillWorkerStub(c))
                        for a, c in zip(addresses, self._channels, strict=True)]
        self._lock = threading.Lock()

    def close(self) -> None:
        for c in self._channels:
            c.close()

    # ---- start-up ------------------------------------------------------------------------

    def check(self, engine: Any, timeout_s: float) -> None:
        """Each worker answers as a ready prefill worker of `engine`'s model (it may still
        be warming up: waits up to `timeout_s` for that), else ValueError naming it."""
        for w in self.workers:
            load = self._ready_load(w, timeout_s)
            who = f"--prefill-workers: {w.address}"
            if load.role != "prefill":
                raise ValueError(f"{who} is a {load.role!r} worker, not a prefill worker")
            try:
                prefix_wire.check_signature(json.loads(load.signature_json),
                                            prefix_wire.signature(engine), who)
            except prefix_wire.PrefixMismatch as e:
                raise ValueError(str(e)) from None
            if load.max_seq_len < engine.max_seq_len:
                raise ValueError(f"{who} has max_seq_len {load.max_seq_len}, less than this "
                                 f"engine's {engine.max_seq_len}: give both the same "
                                 "--max-seq-len")

    def _ready_load(self, w: Worker, timeout_s: float) -> pb.LoadResponse:
        end = time.monotonic() + timeout_s
        while True:
            left = max(0.1, end - time.monotonic())
            try:
                load = w.stub.Load(pb.LoadRequest(), timeout=min(left, 10.0),
                                   wait_for_ready=True)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise ValueError(f"--prefill-workers: {w.address} does not serve "
                                     "jetserve_disagg.PrefillWorker: is it `jetserve serve "
                                     "--role prefill`?") from None
                if time.monotonic() >= end:
                    raise ValueError(f"--prefill-workers: {w.address} is unreachable after "
                                     f"{timeout_s:g} s ({e.code().name}: {e.details()})"
                                     ) from None
                continue
            if load.ready or time.monotonic() >= end:
                if not load.ready:
                    raise ValueError(f"--prefill-workers: {w.address} is still warming up "
                                     f"after {timeout_s:g} s")
                return load
            time.sleep(0.2)

    # ---- serving -------------------------------------------------------------------------

    def pick(self, exclude: set[str]) -> Worker | None:
        """The least loaded worker not in `exclude`, preferring those that are up; None
        when every worker is excluded."""
        now = time.monotonic()
        with self._lock:
            rows = [w for w in self.workers if w.address not in exclude]
            if not rows:
                return None
            w = min(rows, key=lambda w: (w.down_until > now, w.in_flight + w.reported))
            w.in_flight += 1
            return w

    def prefill(self, w: Worker, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """The worker's answer (`pick` counted it in flight); grpc.RpcError on failure,
        after marking the worker down unless it was only full."""
        try:
            out = w.stub.Prefill(request, timeout=self.rpc_timeout_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.mark_down(w)
            raise
        finally:
            with self._lock:
                w.in_flight -= 1
        w.reported = out.queue_depth
        return out

    def mark_down(self, w: Worker) -> None:
        with self._lock:
            w.failures += 1
            w.down_until = time.monotonic() + self.retry_after_s

    def ack(self, w: Worker, uuid: int) -> None:
        """Lets the worker free a prefix; best effort (an unacknowledged one expires)."""
        try:
            w.stub.Ack(pb.AckRequest(uuid=uuid), timeout=5.0)
        except grpc.RpcError as e:
            log.warning("ack of prefix %d to %s failed: %s", uuid, w.address, e.code().name)

    def refresh(self) -> None:
        """Asks every worker for its load (Load): a worker that answers ready is up with
        the queue depth it reports, one that does not is down. What keeps a worker that
        took no calls for a while (one that was down, or reported a long queue) in the
        running."""
        for w in self.workers:
            try:
                load = w.stub.Load(pb.LoadRequest(), timeout=1.0)
            except grpc.RpcError:
                self.mark_down(w)
                continue
            with self._lock:
                w.reported = load.queue_depth
                if load.ready and load.role == "prefill":
                    w.down_until = 0.0

    def refresh_until(self, stopping: threading.Event, interval_s: float = 1.0) -> None:
        """`refresh` every interval_s until `stopping` (a thread of the decode process)."""
        while not stopping.wait(interval_s):
            self.refresh()

    def loads(self) -> list[dict]:
        """Per worker: what the decode side knows of it (stats, metrics)."""
        now = time.monotonic()
        with self._lock:
            return [{"address": w.address, "in_flight": w.in_flight, "reported": w.reported,
                     "up": w.down_until <= now, "failures": w.failures} for w in self.workers]

"""Both servers over one orchestrator, each on its own asyncio loop and thread; start,
drain, stop.

Concurrency: the gRPC server and the HTTP server each run on their own asyncio loop, in
their own thread (`_LoopThread`), so neither can starve the other: a stream that keeps
one loop busy leaves the other's health checks answering. `Servers` is driven from a
third loop (the main thread's in `jetserve serve`, a background thread's in tests, see
`BackgroundServers`) and only hands coroutines to the two server loops. The orchestrator
runs its own threads; the servers only call its non-blocking `submit` and await its
async streams, which wake whichever loop reads them.

Draining (SIGTERM): first health turns NOT_SERVING / 503 while both servers still take
requests, for `ServerConfig.drain_notice_s` (routers polling health stop sending here);
then both servers stop accepting at once (gRPC refuses new calls, the HTTP
socket closes, health turns NOT_SERVING / 503), in-flight streams run to the end (bounded
by `ServerConfig.drain_timeout_s`; a stream still going then is cut the way its protocol
ends one: a final SSE chunk and `[DONE]`, a gRPC UNAVAILABLE status), then the caller
stops the orchestrator.

Warming up (`warming=True`, see jetserve/server/readiness.py): the servers listen but
refuse requests, health NOT_SERVING / 503, until `ready()`.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from jetserve.server.config import ServerConfig
from jetserve.server.grpc_server import GrpcServer
from jetserve.server.http_server import HttpServer
from jetserve.server.metrics import ServerMetrics
from jetserve.server.readiness import Readiness
from jetserve.server.validation import ModelLimits

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator


class _LoopThread:
    """An asyncio loop running forever on a daemon thread of its own."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro) -> Any:
        """Runs `coro` on this loop and waits for it (from another thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def acall(self, coro) -> Any:
        """Runs `coro` on this loop and awaits it (from another loop)."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _build(make: Any) -> Any:
    return make()  # on the server's loop: grpc.aio binds to the loop it is created on


class Servers:
    """The gRPC and HTTP servers of one orchestrator, each on its own loop thread."""

    def __init__(self, orch: Orchestrator, config: ServerConfig, *, metrics: ServerMetrics | None = None,
                 warming: bool = False):
        self.orch = orch
        self.config = config
        self.readiness = Readiness(warming=warming)
        self.limits = ModelLimits.from_orchestrator(orch, config)
        self.metrics = metrics if metrics is not None else ServerMetrics(orch, config.model_name)
        self.grpc: GrpcServer | None = None
        self.http: HttpServer | None = None
        self._loops: dict[str, _LoopThread] = {}
        self._closed = False
        if config.grpc_port is not None:
            self._loops["grpc"] = t = _LoopThread("jetserve-grpc")
            self.grpc = t.call(_build(lambda: GrpcServer(orch, self.limits, config,
                                                         self.readiness)))
        if config.http_port is not None:
            self._loops["http"] = t = _LoopThread("jetserve-http")
            self.http = t.call(_build(lambda: HttpServer(orch, self.limits, config,
                                                         self.metrics, self.readiness)))

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.port if self.grpc else None

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    async def start(self) -> None:
        try:
            if self.grpc:
                await self._loops["grpc"].acall(self.grpc.start())
            if self.http:
                await self._loops["http"].acall(self.http.start())
        except BaseException:
            # One failed (a taken port): stop the other while its loop still runs, or grpc's
            # finalizer meets a closed loop and prints a traceback after the error.
            await self.stop()  # closes the loop threads too
            raise

    async def ready(self) -> None:
        """The warm-up is over: take requests, health SERVING / 200."""
        self.readiness.set_ready()
        if self.grpc:
            await self._loops["grpc"].acall(self.grpc.set_health())

    async def drain_notice(self) -> None:
        """Health NOT_SERVING / 503 from now on; requests are still taken for
        `drain_notice_s` seconds (then `stop` stops accepting)."""
        if self.readiness.is_draining:
            return
        self.readiness.set_draining()
        if self.grpc:
            await self._loops["grpc"].acall(self.grpc.set_health())
        if self.config.drain_notice_s:
            await asyncio.sleep(self.config.drain_notice_s)

    async def stop(self) -> None:
        """Stops accepting (after the drain notice); waits for in-flight requests (up to the drain timeout). Once
        stopped (or after a failed start, which stops), a no-op."""
        if self._closed:
            return
        await self.drain_notice()
        tasks = []
        if self.grpc:
            tasks.append(self._loops["grpc"].acall(
                self.grpc.stop(grace=self.config.drain_timeout_s)))
        if self.http:
            tasks.append(self._loops["http"].acall(self.http.stop()))
        try:
            await asyncio.gather(*tasks)
        finally:
            self.close()

    def close(self) -> None:
        """Ends the server loops' threads (after stop, or after a failed start)."""
        self._closed = True
        for t in self._loops.values():
            t.close()


class BackgroundServers:
    """Servers on their own thread and loop, for tests and embedding:

        with BackgroundServers(orch, ServerConfig(host="127.0.0.1", grpc_port=0,
                                                  http_port=0)) as s:
            ...s.grpc_port, s.http_port...
    """

    def __init__(self, orch: Orchestrator, config: ServerConfig, **kw: Any):
        self._control = _LoopThread("jetserve-servers")
        self.servers: Servers = self._control.call(_build(lambda: Servers(orch, config, **kw)))

    def _call(self, coro):
        return self._control.call(coro)

    def start(self) -> BackgroundServers:
        self._call(self.servers.start())
        return self

    def ready(self) -> None:
        self._call(self.servers.ready())

    @property
    def grpc_port(self) -> int | None:
        return self.servers.grpc_port

    @property
    def http_port(self) -> int | None:
        return self.servers.http_port

    def stop(self) -> None:
        if self._control.loop.is_closed():
            return
        try:
            self._call(self.servers.stop())
        finally:
            self._control.close()

    def __enter__(self) -> BackgroundServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

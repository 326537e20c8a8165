"""Both servers over one orchestrator, on one asyncio loop; start, drain, stop.

Concurrency: `Servers` lives on one asyncio loop (the main thread's in `jetserve serve`,
a background thread's in tests, see `BackgroundServers`). The orchestrator runs its own
threads; the servers only call its non-blocking `submit` and await its async streams.

Draining (SIGTERM): both servers stop accepting at once (gRPC refuses new calls, the HTTP
socket closes, health turns NOT_SERVING / 503), in-flight streams run to the end (bounded
by `ServerConfig.drain_timeout_s`), then the caller stops the orchestrator.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from jetserve.server.config import ServerConfig
from jetserve.server.grpc_server import GrpcServer
from jetserve.server.http_server import HttpServer
from jetserve.server.metrics import ServerMetrics
from jetserve.server.validation import ModelLimits


class Servers:
    """The gRPC and HTTP servers of one orchestrator."""

    def __init__(self, orch: Any, config: ServerConfig, *, metrics: ServerMetrics | None = None):
        self.orch = orch
        self.config = config
        self.limits = ModelLimits.from_orchestrator(orch, config)
        self.metrics = metrics if metrics is not None else ServerMetrics(orch)
        self.grpc = (GrpcServer(orch, self.limits, config)
                     if config.grpc_port is not None else None)
        self.http = (HttpServer(orch, self.limits, config, self.metrics)
                     if config.http_port is not None else None)

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.port if self.grpc else None

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http else None

    async def start(self) -> None:
        try:
            if self.grpc:
                await self.grpc.start()
            if self.http:
                await self.http.start()
        except BaseException:
            # One failed (a taken port): stop the other while its loop still runs, or grpc's
            # finalizer meets a closed loop and prints a traceback after the error.
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stops accepting; waits for in-flight requests (up to the drain timeout)."""
        tasks = []
        if self.grpc:
            tasks.append(self.grpc.stop(grace=self.config.drain_timeout_s))
        if self.http:
            tasks.append(self.http.stop())
        await asyncio.gather(*tasks)


class BackgroundServers:
    """Servers on their own thread and loop, for tests and embedding:

        with BackgroundServers(orch, ServerConfig(host="127.0.0.1", grpc_port=0,
                                                  http_port=0)) as s:
            ...s.grpc_port, s.http_port...
    """

    def __init__(self, orch: Any, config: ServerConfig, **kw: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jetserve-servers",
                                        daemon=True)
        self._thread.start()
        self.servers: Servers = self._call(self._make(orch, config, kw))

    @staticmethod
    async def _make(orch, config, kw) -> Servers:
        return Servers(orch, config, **kw)  # built on the loop: grpc.aio binds to it

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def start(self) -> BackgroundServers:
        self._call(self.servers.start())
        return self

    @property
    def grpc_port(self) -> int | None:
        return self.servers.grpc_port

    @property
    def http_port(self) -> int | None:
        return self.servers.http_port

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.servers.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> BackgroundServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

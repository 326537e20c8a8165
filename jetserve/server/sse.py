"""Server-sent event responses that cannot be held by a client that stops reading.

Concurrency: on the HTTP server's asyncio loop. An EventStream runs its producer (the
events generator, which merges the request's samples) beside a watcher that waits for
the client's disconnect; whichever ends first ends the response, and closing the
generator cancels the requests, so their slots come free within one generate step.

Slow readers: every send is bounded by the write timeout (one timer per stream).
uvicorn's send waits while the connection's write buffer is over its high-water mark, i.e. while the client reads
nothing; past the timeout the stream is given up, its requests are cancelled and the
connection is aborted. Aborted, not closed: a close would wait, forever, to flush output
the client never reads, keeping the socket and its buffers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.responses import StreamingResponse

from jetserve.server.write_deadline import WriteDeadline

log = logging.getLogger(__name__)

# Where CarryTransport leaves the connection's asyncio transport in the ASGI scope.
TRANSPORT = "jetserve.transport"


class CarryTransport:
    """ASGI middleware that puts each connection's transport in the scope, so a response
    can abort a connection whose client stopped reading (ASGI itself has no way to). It
    must be the outermost layer: it reads the transport off the server's own send."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        # uvicorn's send is a method of its per-request cycle object, which holds the
        # connection's transport. Another server: None (see EventStream).
        if scope["type"] == "http":
            scope[TRANSPORT] = getattr(getattr(send, "__self__", None), "transport", None)
        await self.app(scope, receive, send)


class WriteTimedOut(Exception):
    """The client accepted nothing for the write timeout."""


class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, when the client leaves or
    stops reading for `write_timeout` seconds."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, *, write_timeout: float, **kw: Any):
        super().__init__(content, **kw)
        self.write_timeout = write_timeout

    async def _timed_send(self, deadline: WriteDeadline, send, message) -> None:
        try:
            await deadline.write(send(message))
        except TimeoutError:
            raise WriteTimedOut(f"the client read nothing for {self.write_timeout:g} s "
                                "(write timeout)") from None

    async def __call__(self, scope, receive, send) -> None:
        deadline = WriteDeadline(self.write_timeout)
        producer = asyncio.ensure_future(
            self.stream_response(lambda message: self._timed_send(deadline, send, message)))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait({producer, watcher},
                                         return_when=asyncio.FIRST_COMPLETED)
            if producer in done:
                exc = producer.exception()
                if isinstance(exc, WriteTimedOut):
                    self._abort(scope, exc)
                elif exc is not None and not isinstance(exc, OSError):
                    raise exc
        finally:
            deadline.close()
            producer.cancel()
            watcher.cancel()
            await asyncio.gather(producer, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # runs the source's finally: requests cancelled

    @staticmethod
    def _abort(scope, exc: WriteTimedOut) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "a client"
        log.warning("closing the connection of %s: %s; its requests are cancelled", who, exc)
        transport = scope.get(TRANSPORT)
        if transport is None:
            raise exc  # the server closes a connection whose response failed
        transport.abort()

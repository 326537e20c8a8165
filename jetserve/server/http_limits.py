"""Connection limits of the HTTP server: header, body and idle timeouts, a body size cap.

uvicorn closes a keep-alive connection that stays silent, but nothing else: a client
that trickles its request headers, or its body, one byte at a time holds a socket (and,
with many such clients, the file descriptor table) for as long as it likes, and a body
of any size is read into memory and parsed. Two pieces close those gaps:

- `h11_protocol(header_timeout_s, body_timeout_s)`: uvicorn's h11 protocol with a
  header deadline. A connection must deliver complete request headers within
  `header_timeout_s` of connecting, or on a keep-alive connection of the first byte of
  its next request (uvicorn's keep-alive timeout closes one that stays silent); otherwise
  it gets a 408 (when part of a request came) and is closed. When the server
  answered before the body was in (a refusal), the rest of the body, which is discarded
  unparsed, must arrive within `body_timeout_s` of that answer.
- `BodyLimits`: ASGI middleware in front of the application. A Content-Length over
  `max_body_bytes` is refused with 413 before any of the body is read; a chunked body
  is counted as it arrives and refused the moment it passes the limit, so no oversized
  body is ever buffered whole or parsed. The body must arrive within `body_timeout_s`
  of the headers, else 408 and the connection closes. A refused request's handler sees
  the client as gone (`http.disconnect`); a client that really goes away while its body
  is read is logged as one debug line rather than an ASGI traceback.

Concurrency: both run on uvicorn's event loop; the header deadline is a loop timer per
connection, the body deadline bounds each `receive` of the request being read.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

_TIMEOUT_TEXT = b"request headers not received in time\n"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8"
                     b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(_TIMEOUT_TEXT), _TIMEOUT_TEXT))


class _HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes connections whose request headers do not come in time.

    The protocol waits for headers from the moment the connection is made and from each
    response's end; the wait ends when uvicorn has parsed the next request's headers,
    which it signals by starting a new request cycle (`self.cycle` changes). The clock
    runs from the connection's start, and on a keep-alive connection from the first byte
    of the next request: the silent time before that is the keep-alive timeout's to bound.
    """

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting = False  # for the headers of a request after `_waiting_cycle`
        self._waiting_cycle: Any = None
        self._bytes_since_armed = 0
        super().connection_made(transport)
        self._wait_for_headers(self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._waiting and self._header_timer is None:
            self._arm(self.header_timeout_s)  # a keep-alive connection's next request began
        self._bytes_since_armed += len(data)
        super().data_received(data)
        self._stop_if_headers_came()

    def on_response_complete(self) -> None:
        # SEND_BODY: answered (refused) before the body was in. The client may finish
        # sending it, to be discarded, within the body timeout.
        refused_early = self.conn.their_state is h11.SEND_BODY
        self._wait_for_headers(self.body_timeout_s if refused_early else None)
        super().on_response_complete()
        self._stop_if_headers_came()  # a pipelined request may have been parsed already

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _wait_for_headers(self, timeout: float | None) -> None:
        self._disarm()
        self._waiting, self._waiting_cycle = True, self.cycle
        if timeout is not None:
            self._arm(timeout)

    def _arm(self, timeout: float) -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        self._bytes_since_armed = 0
        self._header_timer = self.loop.call_later(timeout, self._header_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _stop_if_headers_came(self) -> None:
        if self._waiting and self.cycle is not self._waiting_cycle:
            self._waiting = False
            self._disarm()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        log.debug("closing HTTP connection from %s: its request (%s) did not come in time",
                  self.client, self.conn.their_state)
        # A 408 tells a client that had started a request why it was cut off; an idle
        # connection is simply closed, as the keep-alive timeout does.
        if self._bytes_since_armed and self.conn.their_state is h11.IDLE:
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def h11_protocol(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """The protocol class to pass as `uvicorn.Config(http=...)`."""
    return type("HeaderDeadlineH11Protocol", (_HeaderDeadlineProtocol,),
                {"header_timeout_s": float(header_timeout_s),
                 "body_timeout_s": float(body_timeout_s)})


def _json_error(status: int, message: str, *, close: bool) -> tuple[dict, dict]:
    """OpenAI's error shape, as ASGI response messages."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": "body", "code": None}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    return ({"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False})


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed Content-Length before we see it
    return None


class BodyLimits:
    """ASGI middleware: request bodies at most `max_body_bytes`, within `body_timeout_s`."""

    def __init__(self, app: Any, *, max_body_bytes: int, body_timeout_s: float):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            # Refused unread. The connection stays open: what the client still sends of
            # the body is discarded unparsed (for at most the body timeout), so a client
            # that sends its whole body before reading still gets to read this answer.
            for message in _json_error(413, f"request body is {declared} bytes; this "
                                       f"server accepts at most {self.max_body_bytes}",
                                       close=False):
                await send(message)
            return
        guard = _BodyGuard(self, receive, send)
        try:
            await self.app(scope, guard.receive, guard.send)
        except ClientDisconnect:
            if not guard.refused:
                log.debug("client %s went away while sending the body of %s %s",
                          scope.get("client"), scope.get("method"), scope.get("path"))


class _BodyGuard:
    """The `receive` and `send` one request's handler sees."""

    def __init__(self, limits: BodyLimits, receive: Any, send: Any):
        self.limits = limits
        self._receive = receive
        self._send = send
        self.deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
        self.received = 0
        self.body_done = False
        self.refused = False
        self.response_started = False

    async def receive(self) -> dict:
        if self.body_done or self.refused:
            return await self._receive()  # after the body: only http.disconnect comes
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except TimeoutError:
            await self._refuse(408, f"request body not received within "
                                    f"{self.limits.body_timeout_s:g} s of the headers",
                               close=True)
            return {"type": "http.disconnect"}
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.limits.max_body_bytes:
            await self._refuse(413, f"request body exceeds {self.limits.max_body_bytes} "
                                    "bytes, the most this server accepts", close=False)
            return {"type": "http.disconnect"}
        self.body_done = not message.get("more_body", False)
        return message

    async def send(self, message: dict) -> None:
        if self.refused:
            return  # the refusal was the response; the handler's own answer is dropped
        if message["type"] == "http.response.start":
            self.response_started = True
        await self._send(message)

    async def _refuse(self, status: int, message: str, *, close: bool) -> None:
        if not self.response_started:
            for m in _json_error(status, message, close=close):
                await self._send(m)
        self.refused = True
        log.debug("refused a request body with %d: %s", status, message)

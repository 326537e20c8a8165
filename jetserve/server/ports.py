"""Listening ports, bound without SO_REUSEPORT: a port another server already holds is an
error that names it, not a port silently shared with it (gRPC's default shares: the kernel
would spread new connections over both servers).

`jetserve serve` checks its ports with `check_free` before it loads a model, so a taken
port costs a second, not a model load; the servers bind again when they start (a port
taken in between is the same error then).
"""

from __future__ import annotations

import errno
import socket


class PortUnavailable(ValueError):
    """A port cannot be listened on. A ValueError, so the CLI reports it in one line, exit 2."""


def _bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR lets a restarted server take a port that its predecessor's closed
        # connections still hold (TIME_WAIT); on Linux it never lets two sockets listen on
        # one port (that is SO_REUSEPORT, left off).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def unavailable(what: str, host: str, port: int, err: OSError | None = None) -> PortUnavailable:
    """The error for `what` (a flag or a server's name) failing to listen on host:port.

    Without `err` (a library that only says it failed), binding once more finds the reason.
    """
    if err is None and port:
        try:
            _bound(host, port).close()
        except OSError as e:
            err = e
    if err is not None and err.errno == errno.EADDRINUSE:
        reason = "is already in use"
    elif err is not None:
        reason = f"cannot be listened on: {err.strerror or err}"
    else:
        reason = "cannot be listened on"
    return PortUnavailable(f"{what} {port} on {host} {reason}")


def listening_socket(host: str, port: int, *, what: str, backlog: int = 512) -> socket.socket:
    """A non-blocking TCP socket listening on host:port (port 0: a free one)."""
    try:
        sock = _bound(host, port)
    except OSError as e:
        raise unavailable(what, host, port, e) from None
    try:
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise unavailable(what, host, port, e) from None
    sock.setblocking(False)
    return sock


def check_free(host: str, ports: dict[str, int | None]) -> None:
    """Raises PortUnavailable for the first of `ports` ({what: port}) that is taken.

    None (server off) and 0 (any free port) need no check.
    """
    for what, port in ports.items():
        if port:
            try:
                _bound(host, port).close()
            except OSError as e:
                raise unavailable(what, host, port, e) from None

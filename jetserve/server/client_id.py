"""Who sent a request: the `Request.client` the admission queue keys its lanes and shares on.

A client is the address of the machine a request comes from, without the port, so the
connections one machine opens are one client however many it opens. An IPv6 address
counts by its /64 network, which one host can fill with addresses of its own.

Why not the API key: the servers check one shared key, so every authorised request would
be the same client and the fair share would vanish exactly where a key is in use; and an
unchecked key is whatever a client wants, a fresh lane per request. Behind a proxy every
request comes from the proxy's address (X-Forwarded-For is not trusted: any client sets it).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Any

from jetserve.request import MAX_CLIENT_LENGTH


def from_host(host: str | None) -> str:
    """The client of a peer host (an IP address, or whatever else the transport names)."""
    if not host:
        return ""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:  # a unix socket path, a host name: taken as it is
        return host[:MAX_CLIENT_LENGTH]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def from_http(request: Any) -> str:
    """The client of a Starlette request (its ASGI peer)."""
    return from_host(request.client.host if request.client is not None else None)


def from_grpc(context: Any) -> str:
    """The client of a grpc.aio call: context.peer() is 'ipv4:HOST:PORT',
    'ipv6:[HOST]:PORT' (percent-encoded by some gRPC versions) or 'unix:PATH'."""
    peer = urllib.parse.unquote(context.peer() or "")
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return from_host(rest.rpartition(":")[0])
    return from_host(peer)

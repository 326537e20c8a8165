"""The API-key header parsing both servers share, and port checks that refuse a held port."""

import socket

import pytest

from jetserve.server.auth import ApiKey
from jetserve.server.ports import PortUnavailable, check_free, listening_socket


@pytest.mark.parametrize("headers, ok", [
    ([("authorization", "Bearer k3y")], True),
    ([("Authorization", "bearer k3y")], True),
    ([("authorization", "BEARER   k3y  ")], True),
    ([("x-api-key", "k3y")], True),
    ([("X-Api-Key", " k3y ")], True),
    ([("x-api-key", "wrong"), ("authorization", "Bearer k3y")], True),
    ([], False),
    ([("authorization", "k3y")], False),  # no scheme
    ([("authorization", "Basic k3y")], False),
    ([("authorization", "Bearer k3y2")], False),
    ([("x-api-key", "k3")], False),
    ([("x-other", "k3y")], False),
    ([("x-api-key-bin", b"k3y")], False),  # binary gRPC metadata
])
def test_api_key_headers(headers, ok):
    assert ApiKey("k3y").accepts(headers) is ok


def test_a_held_port_is_refused_naming_it():
    with socket.socket() as held:
        # SO_REUSEPORT as gRPC sets it: a socket without it must still be refused.
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"^--http-port {port} on 127.0.0.1 is "
                                                  "already in use$"):
            check_free("127.0.0.1", {"--grpc-port": 0, "--http-port": port})
        with pytest.raises(PortUnavailable, match=f"^HTTP port {port} on 127.0.0.1"):
            listening_socket("127.0.0.1", port, what="HTTP port")
    check_free("127.0.0.1", {"--grpc-port": None, "--http-port": port})  # free again
    with listening_socket("127.0.0.1", 0, what="HTTP port") as s:
        assert s.getsockname()[1] > 0

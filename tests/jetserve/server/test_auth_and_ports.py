"""Port checks that refuse a held port."""

import socket

import pytest

from jetserve.server.ports import PortUnavailable, check_free, listening_socket


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

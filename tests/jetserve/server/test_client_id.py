"""Who a request is from (jetserve/server/client_id.py): the peer's address, port dropped,
IPv6 by its /64 network."""

import types

import pytest

from jetserve.request import MAX_CLIENT_LENGTH
from jetserve.server import client_id


@pytest.mark.parametrize("host, client", [
    ("127.0.0.1", "127.0.0.1"),
    ("::1", "::1"),
    ("[::1]", "::1"),
    ("2001:db8:0:1::5", "2001:db8:0:1::/64"),
    ("2001:db8:0:1:ffff:ffff:ffff:ffff", "2001:db8:0:1::/64"),  # one host's /64: one client
    ("::ffff:10.0.0.7", "10.0.0.7"),  # IPv4 over an IPv6 socket
    ("testclient", "testclient"),
    (None, ""),
])
def test_a_host_is_one_client(host, client):
    assert client_id.from_host(host) == client


def test_a_long_name_is_cut_to_what_a_request_takes():
    assert len(client_id.from_host("/run/" + "x" * 1000)) == MAX_CLIENT_LENGTH


@pytest.mark.parametrize("peer, client", [
    ("ipv4:10.1.2.3:5555", "10.1.2.3"),
    ("ipv6:[2001:db8::1]:5555", "2001:db8::/64"),
    ("ipv6:%5B::1%5D:40000", "::1"),  # percent-encoded by some gRPC versions
    ("unix:/tmp/jetserve.sock", "unix:/tmp/jetserve.sock"),
    ("", ""),
])
def test_a_grpc_peer_is_its_host(peer, client):
    assert client_id.from_grpc(types.SimpleNamespace(peer=lambda: peer)) == client


def test_an_http_peer_is_its_host():
    request = types.SimpleNamespace(client=types.SimpleNamespace(host="127.0.0.2", port=9))
    assert client_id.from_http(request) == "127.0.0.2"
    assert client_id.from_http(types.SimpleNamespace(client=None)) == ""

"""Hostile HTTP clients against real servers on 127.0.0.1: header-trickling (slowloris),
body-trickling, oversized bodies (declared and chunked) and requests that would start
too many sequences. Each is refused or cut off, and /health keeps answering meanwhile.

Servers here have small limits so the tests wait briefly; every wait is bounded by far
more than the limit it waits on, and nothing asserts how long anything took.
"""

import json
import logging
import socket
import time

import grpc
import httpx
import pytest

from jetserve.server.runner import BackgroundServers
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import local_config

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 2.0
KEEP_ALIVE = 4.0
MAX_BODY = 2**20
MAX_PROMPTS = 4
MAX_SUB_REQUESTS = 8
BOUND = 30.0  # generous: the limits above are 1 and 2 s


@pytest.fixture(scope="module")
def limited(tiny_orch):
    config = local_config(header_timeout_s=HEADER_TIMEOUT, body_timeout_s=BODY_TIMEOUT,
                          keep_alive_timeout_s=KEEP_ALIVE,
                          max_body_bytes=MAX_BODY, max_prompts_per_request=MAX_PROMPTS,
                          max_sub_requests=MAX_SUB_REQUESTS)
    with BackgroundServers(tiny_orch, config) as s:
        yield s


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=BOUND)


def _healthy(port: int) -> bool:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def _post_head(length: int | None = None, *, chunked: bool = False) -> bytes:
    head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    head += "Content-Type: application/json\r\n"
    if chunked:
        head += "Transfer-Encoding: chunked\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def _read_until_closed(sock: socket.socket, seconds: float = BOUND) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or `seconds` pass (False)."""
    data = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    """One response's status and JSON body (Content-Length framed), read with a bound."""
    data = b""
    deadline = time.monotonic() + BOUND
    while time.monotonic() < deadline:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) >= length:
                return int(head.split(b" ", 2)[1]), json.loads(body[:length])
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = sock.recv(65536)
        assert chunk, f"server closed without a complete response: {data[:200]!r}"
        data += chunk
    raise AssertionError(f"no complete response within {BOUND} s: {data[:200]!r}")


def test_slowloris_connections_are_closed_and_health_answers(limited):
    port = limited.http_port
    socks = [_connect(port) for _ in range(50)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
        s.setblocking(False)
    still_open, answers = set(range(len(socks))), {}
    deadline = time.monotonic() + BOUND
    try:
        while still_open and time.monotonic() < deadline:
            for i in list(still_open):
                try:
                    data = socks[i].recv(4096)
                except BlockingIOError:
                    try:
                        socks[i].send(b"a")  # one more header byte: never completes them
                    except BlockingIOError:
                        pass
                    except OSError:
                        still_open.discard(i)
                    continue
                except OSError:
                    still_open.discard(i)
                    continue
                if data:
                    answers[i] = answers.get(i, b"") + data
                else:
                    still_open.discard(i)
            assert _healthy(port)
            time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
    assert not still_open, f"{len(still_open)} of 50 trickling connections still open"
    assert any(a.startswith(b"HTTP/1.1 408") for a in answers.values()), answers
    assert _healthy(port)


def test_header_deadline_rearms_after_each_keep_alive_response(limited):
    with _connect(limited.http_port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(s) == (200, {"status": "ok"})
        s.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's headers never end
        closed = False
        deadline = time.monotonic() + BOUND
        while not closed and time.monotonic() < deadline:
            try:
                s.sendall(b"X")  # bytes keep coming, so the idle timeout never fires
            except OSError:
                pass
            _, closed = _read_until_closed(s, 0.2)
    assert closed, "a keep-alive connection trickling its next request was kept open"


def test_idle_keep_alive_connection_is_governed_by_the_keep_alive_timeout(limited):
    assert limited.servers.http._server.config.timeout_keep_alive == KEEP_ALIVE
    with _connect(limited.http_port) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(s)[0] == 200
        # Silent for twice the header timeout, well inside the keep-alive timeout: a
        # header clock started at the response's end would have closed it.
        time.sleep(2 * HEADER_TIMEOUT)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(s)[0] == 200
        data, closed = _read_until_closed(s)
    assert closed and data == b""


def test_idle_new_connection_is_closed(limited):
    with _connect(limited.http_port) as s:
        data, closed = _read_until_closed(s)
    assert closed and data == b""  # nothing was started, so nothing is answered


def test_trickled_body_gets_408_and_is_closed(limited):
    port = limited.http_port
    with _connect(port) as s:
        s.sendall(_post_head(1000) + b'{"prompt": "')
        data, closed = b"", False
        deadline = time.monotonic() + BOUND
        while not closed and time.monotonic() < deadline:
            try:
                s.sendall(b"a")
            except OSError:
                pass
            more, closed = _read_until_closed(s, 0.2)
            data += more
        assert closed, "body-trickling connection kept open"
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"body not received within 2 s" in data
    assert _healthy(port)


def test_huge_declared_body_is_refused_unread(limited):
    port = limited.http_port
    with _connect(port) as s:
        # 50 MB announced, 64 KiB sent: the answer must not wait for the rest.
        s.sendall(_post_head(50 * 2**20) + b'{"prompt": "' + b"a" * 65536)
        status, body = _read_response(s)
        assert status == 413
        assert f"at most {MAX_BODY}" in body["error"]["message"]
        assert _healthy(port)
        # The rest of the body never comes: the connection is not kept for it.
        _, closed = _read_until_closed(s)
        assert closed


def test_refused_body_is_discarded_and_the_connection_reusable(limited):
    size = MAX_BODY + 1
    with _connect(limited.http_port) as s:
        s.sendall(_post_head(size))
        assert _read_response(s)[0] == 413
        s.sendall(b"{" * size)  # would be a nesting bomb, were it parsed
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _read_response(s) == (200, {"status": "ok"})


def test_chunked_oversized_body_is_refused(limited):
    port = limited.http_port
    chunk = b"a" * 65536
    with _connect(port) as s:
        s.sendall(_post_head(chunked=True) + b"c\r\n" + b'{"prompt": "' + b"\r\n")
        for _ in range(MAX_BODY // len(chunk) + 1):  # just over the limit, never terminated
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, body = _read_response(s)
    assert status == 413
    assert f"exceeds {MAX_BODY} bytes" in body["error"]["message"]
    assert _healthy(port)


def test_oversized_body_from_a_real_client_reads_413(limited):
    # httpx sends the whole body before reading: the refusal must still reach it.
    r = httpx.post(f"http://127.0.0.1:{limited.http_port}/v1/completions", timeout=BOUND,
                   content=json.dumps({"prompt": "a" * (MAX_BODY + 1000)}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["param"] == "body"


def _completions(port: int, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=BOUND)


@pytest.mark.parametrize("body, field, expected", [
    # prompt[0] is invalid too: the cap must be checked before any prompt is looked at
    (dict(prompt=[[10**9]] + [[65]] * MAX_PROMPTS, max_tokens=1), "prompt",
     f"at most {MAX_PROMPTS} per request"),
    (dict(prompt=["a"] * 50_000, n=16, max_tokens=1), "prompt",
     f"at most {MAX_PROMPTS} per request"),
    (dict(prompt=[[10**9], [65], [66]], n=3, max_tokens=1), "n",
     f"9 sub-requests; this server runs at most {MAX_SUB_REQUESTS}"),
])
def test_too_many_prompts_or_sub_requests_get_400(limited, body, field, expected):
    r = _completions(limited.http_port, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert expected in r.json()["error"]["message"]
    ok = _completions(limited.http_port, dict(prompt=[[65], [66]], n=4, max_tokens=1))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 8


def test_chat_n_over_the_sub_request_cap_gets_400(limited):
    r = httpx.post(f"http://127.0.0.1:{limited.http_port}/v1/chat/completions", timeout=BOUND,
                   json=dict(messages=[{"role": "user", "content": "hi"}],
                             n=MAX_SUB_REQUESTS + 1, max_tokens=1))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"


def test_grpc_num_samples_over_the_sub_request_cap(limited):
    with grpc.insecure_channel(f"127.0.0.1:{limited.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        req = pb.DecodeRequest(max_tokens=1, num_samples=MAX_SUB_REQUESTS + 1, has_bos=True,
                               token_content=pb.DecodeRequest.TokenContent(token_ids=[65]))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(req, timeout=BOUND))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_samples" in e.value.details()
        ok = list(stub.Decode(pb.DecodeRequest(
            max_tokens=1, num_samples=MAX_SUB_REQUESTS, has_bos=True,
            token_content=pb.DecodeRequest.TokenContent(token_ids=[65])), timeout=BOUND))
        assert ok


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_disconnect_during_body_read_logs_no_traceback(limited):
    seen = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "jetserve.server.http_limits")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(seen)
    loggers[1].setLevel(logging.DEBUG)
    try:
        with _connect(limited.http_port) as s:
            s.sendall(_post_head(1000) + b'{"prompt": "a')
            time.sleep(0.2)  # let the handler start reading the body
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline and not any(
                "went away" in r.getMessage() for r in seen.records):
            time.sleep(0.05)
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(seen)
            lg.setLevel(level)
    assert any("went away" in r.getMessage() for r in seen.records)
    assert not [r for r in seen.records if r.levelno >= logging.WARNING or r.exc_info]


def test_default_body_limit_refuses_the_50_mb_body(tiny_servers):
    with _connect(tiny_servers.http_port) as s:
        s.sendall(_post_head(50 * 2**20))
        status, body = _read_response(s)
    assert status == 413 and f"at most {16 * 2**20}" in body["error"]["message"]

"""Clients that stop reading: they cannot freeze either server, they lose their requests
after the write timeout, and a drain that runs out of time ends streams properly.

Slow readers are raw sockets with a small receive buffer that send a streaming request
and then read nothing, so the server's sends block once the socket buffers are full.
"""

import dataclasses
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jax
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engines import MockEngine
from jetserve.orchestrator import Orchestrator, RequestFinished
from jetserve.server.runner import BackgroundServers
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_MODEL, local_config

SLOTS = 16  # the largest n
LONG = 1000  # tokens per sample: a stalled stream has 16 x 1,000 deltas queued behind it
PROMPT = [70, 111, 111, 32, 98, 97, 114]
ANSWER_BOUND_S = 10.0  # generous: on one shared loop the stall lasted tens of seconds


def _mock_orchestrator(step_delay_s: float):
    engine = MockEngine(max_concurrent_decodes=SLOTS, max_prefill_length=64,
                        max_seq_len=LONG + 64, devices=jax.devices()[:1],
                        step_delay_s=step_delay_s)
    o = Orchestrator.from_engines(engine)
    o.start()
    return o


@pytest.fixture(scope="module")
def fast_orch():
    """Steps as fast as the host goes: a backlog builds up behind a silent client."""
    o = _mock_orchestrator(0.0)
    yield o
    o.stop(drain=False, timeout=30)


@pytest.fixture(scope="module")
def paced_orch():
    """20 ms steps: a 1,000-token request is still running seconds after it started."""
    o = _mock_orchestrator(0.02)
    yield o
    o.stop(drain=False, timeout=30)


def _stats_idle(orch, timeout=120.0) -> dict:
    """Polls until nothing is in flight or `timeout` passes (bounded, not a timing check)."""
    end = time.monotonic() + timeout
    while True:
        s = orch.stats()
        idle = s["in_flight"] == 0 and all(g["slots_in_use"] == 0 for g in s["generate"])
        if idle or time.monotonic() > end:
            return s
        time.sleep(0.05)


def _silent_client(port: int, body: dict, rcvbuf: int = 4096) -> socket.socket:
    """Sends a streaming completion request, then reads nothing."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Before connect: a small window, and a small segment size, which keeps the server's
    # send buffer small too (Linux sizes it from the peer's MSS; loopback's is 64 KB).
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 1024)
    s.connect(("127.0.0.1", port))
    payload = json.dumps({"model": TINY_MODEL, "prompt": PROMPT, "temperature": 0,
                          "ignore_eos": True, "stream": True, **body}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\n"
              + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def _read_to_eof(s: socket.socket, timeout: float = 120.0) -> bytes:
    s.settimeout(timeout)
    out = bytearray()
    while chunk := s.recv(1 << 16):
        out += chunk
    return bytes(out)


def _sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of a chunked HTTP/1.1 SSE response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    text = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        text += rest[:size]
        body = rest[size + 2:]
    return [line[len("data: "):] for line in text.decode().split("\n")
            if line.startswith("data: ")]


class HealthPoller:
    """Asks HTTP /health and gRPC health every 100 ms on two threads; counts the answers
    and records any probe that got no answer within ANSWER_BOUND_S."""

    def __init__(self, servers):
        self.servers = servers
        self.stop = threading.Event()
        self.answered = {"http": 0, "grpc": 0}
        self.failures: list[str] = []

    def _http(self):
        with httpx.Client(timeout=ANSWER_BOUND_S) as c:
            while not self.stop.is_set():
                try:
                    assert c.get(f"http://127.0.0.1:{self.servers.http_port}/health"
                                 ).status_code == 200
                    self.answered["http"] += 1
                except Exception as e:  # noqa: BLE001 (recorded, asserted on by the test)
                    self.failures.append(f"http: {e!r}")
                self.stop.wait(0.1)

    def _grpc(self):
        with grpc.insecure_channel(f"127.0.0.1:{self.servers.grpc_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self.stop.is_set():
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_BOUND_S)
                    assert r.status == health_pb2.HealthCheckResponse.SERVING
                    self.answered["grpc"] += 1
                except Exception as e:  # noqa: BLE001
                    self.failures.append(f"grpc: {e!r}")
                self.stop.wait(0.1)

    def __enter__(self):
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._http, self._grpc)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=3 * ANSWER_BOUND_S)


class Finished(list):
    """RequestFinished events of an orchestrator while the test runs."""

    def __init__(self, orch):
        super().__init__()
        self.orch = orch
        self.lock = threading.Lock()

    def __call__(self, e):
        if isinstance(e, RequestFinished):
            with self.lock:
                self.append(e)

    def __enter__(self):
        self.orch.add_listener(self)
        return self

    def __exit__(self, *exc):
        self.orch.remove_listener(self)


def _wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_never_reading_clients_do_not_freeze_either_server(fast_orch):
    orch = fast_orch
    # The write timeout is out of the way: this is the backlog a client leaves behind
    # when it hangs up after reading nothing while its requests ran to the end.
    clients_n = 3
    with (BackgroundServers(orch, local_config(write_timeout_s=600.0)) as servers,
          Finished(orch) as finished):
        _stats_idle(orch)
        with HealthPoller(servers) as poller:
            clients = [_silent_client(servers.http_port, {"n": SLOTS, "max_tokens": LONG})
                       for _ in range(clients_n)]
            assert _wait_for(lambda: len(finished) == clients_n * SLOTS, 300)
            before = dict(poller.answered)
            for c in clients:
                c.close()  # 3 x 16 x 1,000 deltas to throw away
            poller.stop.wait(3.0)
            after = dict(poller.answered)
        assert poller.failures == []
        assert after["http"] > before["http"] and after["grpc"] > before["grpc"], (before,
                                                                                  after)
        s = _stats_idle(orch)
        assert s["in_flight"] == 0 and all(g["slots_in_use"] == 0 for g in s["generate"]), s


def test_a_client_that_reads_nothing_is_cut_off_after_the_write_timeout(paced_orch):
    orch = paced_orch
    with (BackgroundServers(orch, local_config(write_timeout_s=1.0)) as servers,
          Finished(orch) as finished):
        _stats_idle(orch)
        s = _silent_client(servers.http_port, {"n": SLOTS, "max_tokens": LONG})
        # Reading nothing, the client loses its requests (well before 16 x 1,000 tokens)...
        _wait_for(lambda: len(finished) == SLOTS, 60)
        assert [e.finish_reason for e in finished] == ["cancelled"] * SLOTS
        assert all(e.completion_tokens < LONG for e in finished)
        stats = _stats_idle(orch)
        assert stats["in_flight"] == 0, stats
        # ...and its connection, which the server drops with its unsent output (a close
        # would wait for the client to read it) while the client still reads nothing.
        uvicorn_state = servers.servers.http._server.server_state
        assert _wait_for(lambda: not uvicorn_state.connections, 30)
        # What was buffered in the kernel arrives, then EOF, the stream unfinished.
        try:
            raw = _read_to_eof(s, timeout=60)
        except ConnectionResetError:
            raw = b""
        s.close()
        assert b"[DONE]" not in raw


def _stop_in_background(servers) -> ThreadPoolExecutor:
    pool = ThreadPoolExecutor(1)
    pool.submit(servers.stop)
    return pool


def test_a_stream_cut_by_the_drain_timeout_ends_with_a_final_chunk_and_done(paced_orch):
    orch = paced_orch
    servers = BackgroundServers(orch, dataclasses.replace(local_config(), drain_timeout_s=1.0)).start()
    try:
        _stats_idle(orch)
        s = _silent_client(servers.http_port, {"n": SLOTS - 1, "max_tokens": LONG})
        plain = ThreadPoolExecutor(1).submit(
            httpx.post, f"http://127.0.0.1:{servers.http_port}/v1/completions", timeout=60,
            json={"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True})
        end = time.monotonic() + 60
        while orch.stats()["in_flight"] < SLOTS and time.monotonic() < end:
            time.sleep(0.02)
        pool = _stop_in_background(servers)  # drain: 1 s, and these are far from done
        time.sleep(2.0)  # read nothing until the drain timeout has passed
        events = _sse_events(_read_to_eof(s))
        pool.shutdown(wait=True)
        plain = plain.result()
    finally:
        servers.stop()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"]
    finals = {}
    for e in events[:-2]:
        for c in json.loads(e)["choices"]:
            if c["finish_reason"] is not None:
                finals[c["index"]] = c["finish_reason"]
    assert finals == {i: "cancelled" for i in range(SLOTS - 1)}, finals
    # A non-streaming request cut the same way is refused as the server going away.
    assert plain.status_code == 503, plain.text
    assert "shutting down" in plain.json()["error"]["message"]


def test_a_grpc_stream_cut_by_the_drain_timeout_ends_unavailable(paced_orch):
    orch = paced_orch
    servers = BackgroundServers(orch, dataclasses.replace(local_config(), drain_timeout_s=1.0)).start()
    try:
        _stats_idle(orch)
        with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}") as ch:
            call = pb_grpc.OrchestratorStub(ch).Decode(pb.DecodeRequest(
                max_tokens=LONG, has_bos=True, ignore_eos=True, num_samples=SLOTS,
                token_content=pb.DecodeRequest.TokenContent(token_ids=PROMPT)), timeout=120)
            next(call)
            pool = _stop_in_background(servers)
            time.sleep(2.0)  # read nothing until the drain timeout has passed
            with pytest.raises(grpc.RpcError) as e:
                for _ in call:
                    pass
            pool.shutdown(wait=True)
    finally:
        servers.stop()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in e.value.details()


def test_a_grpc_client_that_reads_nothing_loses_its_stream_after_the_write_timeout(paced_orch):
    orch = paced_orch
    with (BackgroundServers(orch, local_config(write_timeout_s=1.0)) as servers,
          Finished(orch) as finished):
        _stats_idle(orch)
        # A small flow-control window, as a client that consumes nothing soon leaves.
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        with grpc.insecure_channel(f"127.0.0.1:{servers.grpc_port}", options=options) as ch:
            call = pb_grpc.OrchestratorStub(ch).Decode(pb.DecodeRequest(
                max_tokens=LONG, has_bos=True, ignore_eos=True, num_samples=SLOTS,
                token_content=pb.DecodeRequest.TokenContent(token_ids=PROMPT)), timeout=120)
            _wait_for(lambda: len(finished) == SLOTS, 60)  # reading nothing meanwhile
            assert [e.finish_reason for e in finished] == ["cancelled"] * SLOTS
            assert all(e.completion_tokens < LONG for e in finished)
            with pytest.raises(grpc.RpcError) as e:
                for _ in call:
                    pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "write timeout" in e.value.details()
        stats = _stats_idle(orch)
        assert stats["in_flight"] == 0, stats

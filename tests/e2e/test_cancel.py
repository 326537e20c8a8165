"""Cancelled (gRPC) and disconnected (HTTP) streams give their slots back: after 3 x
max_concurrent_decodes streams are dropped mid-way, nothing is left in flight and new
requests run at once."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from jetserve.orchestrator import RequestFinished
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_ENGINE, TINY_MODEL

SLOTS = TINY_ENGINE.max_concurrent_decodes
STREAMS = 3 * SLOTS
LONG = 200  # tokens a dropped stream would have produced
PROMPT = [70, 111, 111, 32, 98, 97, 114]


@pytest.fixture
def finished(tiny_orch):
    """RequestFinished events of the orchestrator while the test runs."""
    events: list[RequestFinished] = []
    lock = threading.Lock()

    def on_event(e):
        if isinstance(e, RequestFinished):
            with lock:
                events.append(e)

    tiny_orch.add_listener(on_event)
    yield events
    tiny_orch.remove_listener(on_event)


def _wait_idle(orch, timeout=60.0) -> dict:
    """Polls stats until nothing is in flight (bounded wait, not a timing assertion)."""
    end = time.monotonic() + timeout
    while True:
        s = orch.stats()
        if s["in_flight"] == 0 and all(g["slots_in_use"] == 0 for g in s["generate"]):
            return s
        if time.monotonic() > end:
            return s
        time.sleep(0.05)


def _check_dropped_and_reusable(orch, finished, run_new):
    s = _wait_idle(orch)
    assert s["in_flight"] == 0, s
    assert all(g["slots_in_use"] == 0 for g in s["generate"]), s
    assert s["admission_queue"] == 0
    dropped = list(finished)
    assert len(dropped) == STREAMS
    assert all(e.finish_reason == "cancelled" for e in dropped), [e.finish_reason
                                                                 for e in dropped]
    assert all(e.completion_tokens < LONG for e in dropped)
    # A full set of new requests, one per slot, all run to the end.
    with ThreadPoolExecutor(SLOTS) as pool:
        counts = list(pool.map(lambda _: run_new(), range(SLOTS)))
    assert counts == [8] * SLOTS


def test_cancelled_grpc_streams_free_their_slots(tiny_servers, tiny_orch, finished):
    _wait_idle(tiny_orch)
    with grpc.insecure_channel(f"127.0.0.1:{tiny_servers.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        req = lambda n: pb.DecodeRequest(max_tokens=n, has_bos=True, ignore_eos=True,
                                         token_content=pb.DecodeRequest.TokenContent(
                                             token_ids=PROMPT))

        def drop_midway(_):
            call = stub.Decode(req(LONG), timeout=300)
            got = [next(call), next(call)]
            call.cancel()
            return len(got)

        with ThreadPoolExecutor(STREAMS) as pool:
            assert list(pool.map(drop_midway, range(STREAMS))) == [2] * STREAMS

        def run_new():
            msgs = list(stub.Decode(req(8), timeout=300))
            return sum(len(m.stream_content.samples[0].token_ids) for m in msgs)

        _check_dropped_and_reusable(tiny_orch, finished, run_new)


def test_disconnected_http_streams_free_their_slots(tiny_servers, tiny_orch, finished):
    _wait_idle(tiny_orch)
    base = f"http://127.0.0.1:{tiny_servers.http_port}"
    body = lambda n: {"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": n,
                      "temperature": 0, "ignore_eos": True}

    def drop_midway(_):
        with httpx.Client(base_url=base, timeout=300) as c:
            with c.stream("POST", "/v1/completions", json={**body(LONG), "stream": True}) as r:
                assert r.status_code == 200
                events = 0
                for line in r.iter_lines():
                    events += line.startswith("data: ")
                    if events == 2:
                        break  # leaving the block closes the connection mid-stream
        return events

    with ThreadPoolExecutor(STREAMS) as pool:
        assert list(pool.map(drop_midway, range(STREAMS))) == [2] * STREAMS

    def run_new():
        r = httpx.post(f"{base}/v1/completions", json=body(8), timeout=300)
        return r.json()["usage"]["completion_tokens"]

    _check_dropped_and_reusable(tiny_orch, finished, run_new)


def test_disconnected_non_streaming_requests_are_cancelled(tiny_servers, tiny_orch, finished):
    import json
    import socket

    _wait_idle(tiny_orch)
    payload = json.dumps({"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": LONG,
                          "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    socks = []
    for _ in range(STREAMS):
        s = socket.create_connection(("127.0.0.1", tiny_servers.http_port))
        s.sendall(head.encode() + payload)
        socks.append(s)
    # Wait until all of them are admitted (bounded poll), then hang up on every one.
    end = time.monotonic() + 60
    while tiny_orch.stats()["in_flight"] + len(finished) < STREAMS and time.monotonic() < end:
        time.sleep(0.01)
    for s in socks:
        s.close()

    def run_new():
        r = httpx.post(f"http://127.0.0.1:{tiny_servers.http_port}/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 8, "ignore_eos": True},
                       timeout=300)
        return r.json()["usage"]["completion_tokens"]

    _check_dropped_and_reusable(tiny_orch, finished, run_new)

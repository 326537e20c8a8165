"""An error inside the engine, seen by clients of both servers (the session servers): a
prefill or a generate step that raises ends its requests with HTTP 500 (completions and
chat), an SSE error event (streams) or gRPC INTERNAL, whose text names the request's id
and says the server logged it, and carries nothing of the exception; the log has the
traceback under that id. The servers serve again once the engine does."""

import json
import logging
import re

import grpc
import httpx
import pytest

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_MODEL

# What the engine raises: text no client may see.
SECRET = "device buffer 0x7f3a at /opt/secret/weights.bin has shape (7, 3)"
ID = re.compile(r"internal error while handling request (\w+); the server log has the details")


class EngineFault(RuntimeError):
    pass


def _raise(*args, **kwargs):
    raise EngineFault(SECRET)


@pytest.fixture(scope="module")
def http(tiny_servers):
    with httpx.Client(base_url=f"http://127.0.0.1:{tiny_servers.http_port}", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(tiny_servers):
    with grpc.insecure_channel(f"127.0.0.1:{tiny_servers.grpc_port}") as ch:
        yield pb_grpc.OrchestratorStub(ch)


@pytest.fixture
def failing_prefill(tiny_orch, monkeypatch, caplog):
    """Every prefill raises EngineFault while the test runs; the log is captured."""
    for engine in tiny_orch.prefill_engines:
        monkeypatch.setattr(engine, "prefill", _raise)
    with caplog.at_level(logging.ERROR):
        yield caplog


def _request_id(text: str) -> str:
    """The request id a client-facing error names; it shows nothing of the exception."""
    assert SECRET not in text and "EngineFault" not in text and "0x7f3a" not in text, text
    m = ID.search(text)
    assert m, text
    return m.group(1)


def _assert_logged(caplog, rid: str) -> None:
    """A log record names the request and has the engine's traceback."""
    records = [r for r in caplog.records if rid in r.getMessage() and r.exc_info]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]
    assert records[0].exc_info[0] is EngineFault and SECRET in caplog.text


def _sse_error(r: httpx.Response) -> dict:
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    return next(e["error"] for e in events if "error" in e)


BODIES = {
    "completions": ("/v1/completions", {"model": TINY_MODEL, "prompt": "hi", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"model": TINY_MODEL, "max_tokens": 2,
                                      "messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.mark.parametrize("route", list(BODIES))
def test_http_500_names_the_request_not_the_exception(http, failing_prefill, route):
    path, body = BODIES[route]
    r = http.post(path, json=body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error"
    _assert_logged(failing_prefill, _request_id(r.text))


@pytest.mark.parametrize("route", list(BODIES))
def test_sse_error_event_names_the_request_not_the_exception(http, failing_prefill, route):
    path, body = BODIES[route]
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200  # the stream had started; its error is an event
    err = _sse_error(r)
    assert err["type"] == "server_error"
    _assert_logged(failing_prefill, _request_id(err["message"]))


def test_grpc_internal_names_the_request_not_the_exception(stub, failing_prefill):
    req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=[65, 66]),
                           has_bos=True, max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Decode(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    _assert_logged(failing_prefill, _request_id(e.value.details()))


def test_a_failed_generate_step_names_its_requests(http, tiny_orch, monkeypatch, caplog):
    """A step's failure ends every request in it: one line names them all, after the
    step's traceback."""
    for engine in tiny_orch.generate_engines:
        monkeypatch.setattr(engine, "generate", _raise)
    with caplog.at_level(logging.ERROR):
        r = http.post("/v1/completions", json={"model": TINY_MODEL, "prompt": "hi",
                                               "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 500, r.text
    rid = _request_id(r.text)
    named = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(named) == 1 and "failed on engine" in named[0].getMessage()
    assert any(rec.exc_info and rec.exc_info[0] is EngineFault for rec in caplog.records)
    monkeypatch.undo()
    ok = http.post("/v1/completions", json={"model": TINY_MODEL, "prompt": "hi",
                                            "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2

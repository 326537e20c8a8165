"""Inputs a hostile client sends, against both servers: text no tokenizer accepts (lone
surrogates), JSON nested deep enough to blow the parser's recursion, integers the engine's
arrays cannot hold, huge stop strings and huge bad values. Each is refused with 400 /
INVALID_ARGUMENT naming the field, before admission, with a short message; a bug inside a
handler is a 500 / INTERNAL naming a request id, with the traceback in the log."""

import json
import logging

import grpc
import httpx
import pytest

from jetserve.server import grpc_server
from jetserve.server import openai_format as fmt
from jetserve.server.validation import MAX_JSON_DEPTH, MAX_STOP_LENGTH, MAX_TOP_K
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_MODEL

Tok = pb.DecodeRequest.TokenContent
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# JSON as a client writes it by hand: \ud800 alone is valid JSON but not valid Unicode.
SURROGATE = "a\\ud800b"


def _chat(*contents, **kw) -> bytes:
    msgs = ",".join(f'{{"role": "{r}", "content": "{c}"}}'
                    for r, c in zip(("system", "user", "assistant"), contents, strict=False))
    return f'{{"messages": [{msgs}], "max_tokens": 2{_extra(kw)}}}'.encode()


def _completion(prompt: str, **kw) -> bytes:
    return f'{{"prompt": {prompt}, "max_tokens": 2{_extra(kw)}}}'.encode()


def _extra(kw: dict) -> str:
    return "".join(f', "{k}": {v if isinstance(v, str) else json.dumps(v)}'
                   for k, v in kw.items())


# (case id, path, raw body, the field the error must name)
HTTP_CASES = [
    ("surrogate in prompt", COMPLETIONS, _completion(f'"{SURROGATE}"'), "prompt"),
    ("surrogate in a prompt of a list", COMPLETIONS,
     _completion(f'["fine", "also fine", "ok", "{SURROGATE}"]'), "prompt[3]"),
    ("low surrogate alone", COMPLETIONS, _completion('"\\udc80"'), "prompt"),
    ("surrogate in chat content", CHAT, _chat("be brief", SURROGATE), "messages[1].content"),
    ("surrogate in a chat text part", CHAT,
     f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": '
     f'"{SURROGATE}"}}]}}]}}'.encode(), "messages[0].content[0].text"),
    ("surrogate in a stop string", COMPLETIONS,
     _completion('"hi"', stop=f'["ok", "{SURROGATE}"]'), "stop[1]"),
    ("surrogate as the stop string", COMPLETIONS, _completion('"hi"', stop=f'"{SURROGATE}"'),
     "stop"),
    ("stop string too long", COMPLETIONS,
     _completion('"hi"', stop=["x" * (MAX_STOP_LENGTH + 1)]), "stop[0]"),
    ("body nested 100,000 deep", COMPLETIONS, b"[" * 100_000, "body"),
    ("prompt nested too deep", COMPLETIONS,
     _completion("[" * (MAX_JSON_DEPTH + 1) + "1" + "]" * (MAX_JSON_DEPTH + 1)), "body"),
    ("top_k beyond int32", COMPLETIONS, _completion('"hi"', top_k=MAX_TOP_K + 1), "top_k"),
    ("top_k 2**63", COMPLETIONS, _completion('"hi"', top_k=2**63), "top_k"),
    ("chat top_k beyond int32", CHAT, _chat("hi", top_k=2**31), "top_k"),
    ("number of 5,000 digits", COMPLETIONS, _completion('"hi"', max_tokens="9" * 5000),
     "body"),
]


@pytest.fixture(scope="module")
def http(tiny_servers):
    with httpx.Client(base_url=f"http://127.0.0.1:{tiny_servers.http_port}",
                      timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(tiny_servers):
    with grpc.insecure_channel(f"127.0.0.1:{tiny_servers.grpc_port}") as ch:
        yield pb_grpc.OrchestratorStub(ch)


def _post(http, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path, raw, field", [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_http_hostile_input_is_400_naming_the_field(http, tiny_orch, path, raw, field):
    submitted = tiny_orch.stats()["counters"].get("submitted", 0)
    r = _post(http, path, raw)
    assert r.status_code == 400, r.text[:500]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field and field in err["message"], err
    # Refused at the edge: nothing reached the orchestrator (top_k used to fail there).
    assert tiny_orch.stats()["counters"].get("submitted", 0) == submitted


@pytest.mark.parametrize("value", ["x" * 5_000_000, 10**4000, [[1] * 1000] * 1000],
                         ids=["5 MB string", "4,000-digit integer", "a million-item list"])
def test_http_error_echoes_a_bad_value_cut_short(http, value):
    r = _post(http, COMPLETIONS, json.dumps({"prompt": "hi", "max_tokens": value}).encode())
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens"
    assert len(r.content) < 1024, len(r.content)


def test_http_largest_top_k_still_serves(http):
    r = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "temperature": 1.0,
                                     "top_k": MAX_TOP_K, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_http_bug_in_a_handler_is_500_naming_the_request(http, monkeypatch, caplog):
    def broken(*a, **kw):
        raise RuntimeError("a bug in the handler")

    monkeypatch.setattr(fmt, "prepare_completion", broken)
    with caplog.at_level(logging.ERROR, logger="jetserve.server"):
        r = http.post(COMPLETIONS, json={"model": TINY_MODEL, "prompt": "hi"})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error"
    rid = err["message"].split("request ")[1].split(";")[0]
    assert rid.startswith("req-"), err
    logged = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "a bug in the handler" in caplog.text  # the traceback


def _decode(stub, **kw) -> list[pb.DecodeResponse]:
    fields = dict(max_tokens=2, token_content=Tok(token_ids=[65, 66]), has_bos=True)
    fields.update(kw)
    return list(stub.Decode(pb.DecodeRequest(**fields), timeout=60))


@pytest.mark.parametrize("stop, field", [
    (["ok", "x" * (MAX_STOP_LENGTH + 1)], "stop[1]"),
    (["y" * 1_000_000], "stop[0]"),
], ids=["just too long", "1 MB"])
def test_grpc_long_stop_string_is_invalid(stub, tiny_orch, stop, field):
    submitted = tiny_orch.stats()["counters"].get("submitted", 0)
    with pytest.raises(grpc.RpcError) as e:
        _decode(stub, stop=stop)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details() and len(e.value.details()) < 1024
    assert tiny_orch.stats()["counters"].get("submitted", 0) == submitted


@pytest.mark.parametrize("target", ["build", "stream"])
def test_grpc_bug_in_decode_is_internal_naming_the_call(stub, monkeypatch, caplog, target):
    def broken(*a, **kw):
        raise RuntimeError("a bug in Decode")

    if target == "build":
        monkeypatch.setattr(grpc_server.OrchestratorServicer, "build_requests", broken)
    else:  # after the requests are admitted, while their tokens stream
        monkeypatch.setattr(grpc_server, "_messages", broken)
    with caplog.at_level(logging.ERROR, logger="jetserve.server"), \
            pytest.raises(grpc.RpcError) as e:
        _decode(stub)
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
    call_id = e.value.details().split("request ")[1].split(";")[0]
    assert call_id.startswith("call-")
    logged = [rec for rec in caplog.records if call_id in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert "a bug in Decode" in caplog.text


def test_both_servers_serve_after_hostile_inputs(http, stub):
    r = http.post(CHAT, json={"messages": [{"role": "user", "content": "hi \U0001F600"}],
                              "max_tokens": 2, "ignore_eos": True, "stop": ["\U0001F600"]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    msgs = _decode(stub, ignore_eos=True, top_k=MAX_TOP_K, temperature=1.0)
    assert sum(len(m.stream_content.samples[0].token_ids) for m in msgs) == 2

"""Every kind of bad input, against both servers: INVALID_ARGUMENT / HTTP 400 with a
message naming the field; and the server keeps serving (a valid request then succeeds)."""

import json

import grpc
import httpx
import pytest

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_ENGINE, TINY_MODEL

# Prompts past max_prefill_length are prefilled in chunks; the cap is max_seq_len less the
# one token to generate.
TOO_LONG = TINY_ENGINE.max_seq_len
Tok = pb.DecodeRequest.TokenContent
Text = pb.DecodeRequest.TextContent


def _ok(**kw):
    base = dict(max_tokens=4, token_content=Tok(token_ids=[65, 66, 67]), has_bos=True)
    base.update(kw)
    return base


# (case id, DecodeRequest fields, field the error must name)
GRPC_CASES = [
    ("missing prompt", dict(max_tokens=4), "content"),
    ("empty text", _ok(token_content=None, text_content=Text(text="")), "text_content.text"),
    ("empty token ids", _ok(token_content=Tok(token_ids=[])), "token_content.token_ids"),
    ("id above vocab", _ok(token_content=Tok(token_ids=[65, 256])), "token_content.token_ids"),
    ("negative id", _ok(token_content=Tok(token_ids=[-1])), "token_content.token_ids"),
    ("prompt too long", _ok(token_content=Tok(token_ids=[65] * TOO_LONG)),
     "token_content.token_ids"),
    ("negative max_tokens", _ok(max_tokens=-3), "max_tokens"),
    ("zero max_tokens", _ok(max_tokens=0), "max_tokens"),
    ("too many max_tokens", _ok(max_tokens=TINY_ENGINE.max_seq_len), "max_tokens"),
    ("nan temperature", _ok(temperature=float("nan")), "temperature"),
    ("inf temperature", _ok(temperature=float("inf")), "temperature"),
    ("negative temperature", _ok(temperature=-0.5), "temperature"),
    ("top_p above 1", _ok(top_p=1.5), "top_p"),
    ("top_p zero", _ok(top_p=0.0), "top_p"),
    ("negative top_k", _ok(top_k=-7), "top_k"),
    ("min_p above 1", _ok(min_p=2.0), "min_p"),
    ("zero repetition_penalty", _ok(repetition_penalty=0.0), "repetition_penalty"),
    ("huge frequency_penalty", _ok(frequency_penalty=9.0), "frequency_penalty"),
    ("negative seed", _ok(seed=-1), "seed"),
    ("too many logprobs", _ok(logprobs=99), "logprobs"),
    ("too many samples", _ok(num_samples=1000), "num_samples"),
    ("empty stop string", _ok(stop=[""]), "stop"),
    ("stop id above vocab", _ok(stop_token_ids=[999]), "stop_token_ids"),
]

# Raw DecodeRequest bytes no protobuf library would produce: (case id, bytes, field).
GRPC_RAW_CASES = [
    # text_content (5) { text (1): b"\xff" }: invalid UTF-8
    ("invalid utf-8", bytes([0x20, 0x04, 0x2A, 0x03, 0x0A, 0x01, 0xFF]), "text_content.text"),
    # max_tokens (4) sent as a string: wrong type
    ("max_tokens wrong type", bytes([0x22, 0x01, 0x35, 0x32, 0x03, 0x0A, 0x01, 0x41]),
     "max_tokens"),
    # temperature (11, double) sent as a varint: wrong type
    ("temperature wrong type", bytes([0x20, 0x04, 0x58, 0x01, 0x32, 0x03, 0x0A, 0x01, 0x41]),
     "temperature"),
]


@pytest.fixture(scope="module")
def channel(tiny_servers):
    with grpc.insecure_channel(f"127.0.0.1:{tiny_servers.grpc_port}") as ch:
        yield ch


def _expect_invalid(call, field):
    with pytest.raises(grpc.RpcError) as e:
        list(call())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details(), e.value.details()


@pytest.mark.parametrize("fields, field", [c[1:] for c in GRPC_CASES],
                         ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(channel, fields, field):
    stub = pb_grpc.OrchestratorStub(channel)
    _expect_invalid(lambda: stub.Decode(pb.DecodeRequest(**fields), timeout=60), field)


@pytest.mark.parametrize("raw, field", [c[1:] for c in GRPC_RAW_CASES],
                         ids=[c[0] for c in GRPC_RAW_CASES])
def test_grpc_malformed_bytes(channel, raw, field):
    decode = channel.unary_stream("/jetstream_proto.Orchestrator/Decode",
                                  request_serializer=lambda b: b,
                                  response_deserializer=pb.DecodeResponse.FromString)
    _expect_invalid(lambda: decode(raw, timeout=60), field)


def test_grpc_unknown_lora_adapter_is_not_found(channel):
    """An adapter this server does not hold: NOT_FOUND (issue #23; it was INVALID_ARGUMENT
    while no server held adapters), naming the field."""
    stub = pb_grpc.OrchestratorStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Decode(pb.DecodeRequest(**_ok(lora_adapter_id="my-adapter")), timeout=60))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
    assert "lora_adapter_id" in e.value.details(), e.value.details()


def test_grpc_serves_after_bad_inputs(channel):
    stub = pb_grpc.OrchestratorStub(channel)
    msgs = list(stub.Decode(pb.DecodeRequest(**_ok(ignore_eos=True)), timeout=60))
    assert sum(len(m.stream_content.samples[0].token_ids) for m in msgs) == 4


def _completion(**kw):
    return {"model": TINY_MODEL, "prompt": "hello", "max_tokens": 4, **kw}


# (case id, path, raw body, field the error must name)
HTTP_CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi",', "body"),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', "body"),
    ("body not an object", "/v1/completions", b'["hello"]', "body"),
    ("missing prompt", "/v1/completions", {"model": TINY_MODEL}, "prompt"),
    ("empty prompt", "/v1/completions", _completion(prompt=""), "prompt"),
    ("empty prompt list", "/v1/completions", _completion(prompt=[]), "prompt"),
    ("prompt wrong type", "/v1/completions", _completion(prompt=42), "prompt"),
    ("id above vocab", "/v1/completions", _completion(prompt=[65, 256]), "prompt"),
    ("negative id", "/v1/completions", _completion(prompt=[65, -1]), "prompt"),
    ("prompt too long", "/v1/completions", _completion(prompt="a" * TOO_LONG), "prompt"),
    ("negative max_tokens", "/v1/completions", _completion(max_tokens=-1), "max_tokens"),
    ("too many max_tokens", "/v1/completions", _completion(max_tokens=10**6), "max_tokens"),
    ("max_tokens wrong type", "/v1/completions", _completion(max_tokens="5"), "max_tokens"),
    ("max_tokens float", "/v1/completions", _completion(max_tokens=2.5), "max_tokens"),
    ("nan temperature", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}',
     "temperature"),
    ("inf temperature", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}',
     "temperature"),
    ("temperature out of range", "/v1/completions", _completion(temperature=1e9),
     "temperature"),
    ("temperature wrong type", "/v1/completions", _completion(temperature="hot"),
     "temperature"),
    ("top_p above 1", "/v1/completions", _completion(top_p=2.0), "top_p"),
    ("negative presence_penalty", "/v1/completions", _completion(presence_penalty=-5.0),
     "presence_penalty"),
    ("n zero", "/v1/completions", _completion(n=0), "n"),
    ("n wrong type", "/v1/completions", _completion(n="2"), "n"),
    ("negative seed", "/v1/completions", _completion(seed=-1), "seed"),
    ("too many logprobs", "/v1/completions", _completion(logprobs=50), "logprobs"),
    ("echo wrong type", "/v1/completions", _completion(echo="yes"), "echo"),
    ("stop wrong type", "/v1/completions", _completion(stop=7), "stop"),
    ("unknown model", "/v1/completions", _completion(model="gpt-17"), "model"),
    ("chat missing messages", "/v1/chat/completions", {"model": TINY_MODEL}, "messages"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, "messages"),
    ("chat bad role", "/v1/chat/completions",
     {"messages": [{"role": "oracle", "content": "hi"}]}, "messages[0].role"),
    ("chat content wrong type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat nan top_p", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', "top_p"),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat negative max_tokens", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -2}, "max_tokens"),
]


@pytest.fixture(scope="module")
def http(tiny_servers):
    with httpx.Client(base_url=f"http://127.0.0.1:{tiny_servers.http_port}",
                      timeout=60) as c:
        yield c


@pytest.mark.parametrize("path, body, field", [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(http, path, body, field):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field and field in err["message"], err


def test_http_serves_after_bad_inputs(http):
    r = http.post("/v1/completions", json=_completion(ignore_eos=True, temperature=0))
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4

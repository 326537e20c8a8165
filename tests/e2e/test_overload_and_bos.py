"""Servers over a MockEngine orchestrator (outputs are hand-computable: first token =
sum(prompt) mod 256, then +1 per step): BOS handling as JetStream clients expect, and
overload -> RESOURCE_EXHAUSTED / HTTP 429 while everyone else is served."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jax
import pytest

from engines import MockEngine
from jetserve.orchestrator import Orchestrator, OrchestratorConfig
from jetserve.server.runner import BackgroundServers
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import local_config

BOS = 1
LONG = 30  # steps of 20 ms each: requests stay in flight while the others arrive


@pytest.fixture(scope="module")
def mock_servers():
    engine = MockEngine(max_concurrent_decodes=1, max_prefill_length=64, max_seq_len=128,
                        devices=jax.devices()[:1], step_delay_s=0.02)
    engine.tokenizer.bos_id = BOS  # the byte tokenizer has none; give it one
    orch = Orchestrator.from_engines(engine, config=OrchestratorConfig(max_queued_requests=1))
    orch.start()
    try:
        with BackgroundServers(orch, local_config()) as s:
            yield s
    finally:
        orch.stop(drain=False, timeout=30)


@pytest.fixture(scope="module")
def stub(mock_servers):
    with grpc.insecure_channel(f"127.0.0.1:{mock_servers.grpc_port}") as ch:
        yield pb_grpc.OrchestratorStub(ch)


def _tokens(stub, n=3, **content) -> list[int]:
    msgs = stub.Decode(pb.DecodeRequest(max_tokens=n, **content), timeout=60)
    return [t for m in msgs for t in m.stream_content.samples[0].token_ids]


@pytest.mark.parametrize("has_bos, first", [(False, BOS + 3 + 4), (True, 3 + 4)])
def test_grpc_token_content_gets_bos_unless_has_bos(stub, has_bos, first):
    content = pb.DecodeRequest.TokenContent(token_ids=[3, 4])
    assert _tokens(stub, token_content=content, has_bos=has_bos) == [first, first + 1,
                                                                     first + 2]


@pytest.mark.parametrize("has_bos, first", [(False, BOS + 97 + 98), (True, 97 + 98)])
def test_grpc_text_content_gets_bos_unless_has_bos(stub, has_bos, first):
    content = pb.DecodeRequest.TextContent(text="ab")
    assert _tokens(stub, text_content=content, has_bos=has_bos)[0] == first


def test_http_text_prompt_gets_bos_token_prompt_verbatim(mock_servers):
    base = f"http://127.0.0.1:{mock_servers.http_port}/v1/completions"
    body = {"max_tokens": 1, "logprobs": 0, "temperature": 0}
    by_text = httpx.post(base, json={**body, "prompt": "ab"}, timeout=60).json()
    by_ids = httpx.post(base, json={**body, "prompt": [97, 98]}, timeout=60).json()
    assert by_text["usage"]["prompt_tokens"] == 3 and by_ids["usage"]["prompt_tokens"] == 2
    # The first token is the prompt's sum: 196 with BOS, 195 without (lone UTF-8 lead
    # bytes: their text is U+FFFD, and top_logprobs label them by their byte, \xNN).
    for got, first in ((by_text, BOS + 97 + 98), (by_ids, 97 + 98)):
        lp = got["choices"][0]["logprobs"]
        assert lp["tokens"] == [got["choices"][0]["text"]] == ["\ufffd"]
        assert list(lp["top_logprobs"][0]) == [f"bytes:\\x{first:x}"]


def test_grpc_overload_is_resource_exhausted_and_others_are_served(stub):
    content = pb.DecodeRequest.TokenContent(token_ids=[5])

    def one(_):
        try:
            return len(_tokens(stub, n=LONG, token_content=content, has_bos=True))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # when to come back, as 429
                assert ("retry-after", "1") in tuple(e.trailing_metadata())
            return e.code()

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in results
    served = [r for r in results if r != grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert served and all(r == LONG for r in served), results
    assert len(_tokens(stub, token_content=content, has_bos=True)) == 3  # still serving


def test_http_overload_is_429_and_others_are_served(mock_servers):
    url = f"http://127.0.0.1:{mock_servers.http_port}/v1/completions"

    def one(_):
        r = httpx.post(url, json={"prompt": [5], "max_tokens": LONG, "temperature": 0},
                       timeout=120)
        if r.status_code == 429:  # tells the client when to come back
            assert r.headers["retry-after"] == "1"
        return r.status_code, r.json()

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    codes = [c for c, _ in results]
    assert 429 in codes and 200 in codes, codes
    assert set(codes) == {200, 429}
    assert all(b["error"]["type"] == "rate_limit_error" for c, b in results if c == 429)
    assert all(b["usage"]["completion_tokens"] == LONG for c, b in results if c == 200)
    r = httpx.post(url, json={"prompt": [5], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200  # still serving

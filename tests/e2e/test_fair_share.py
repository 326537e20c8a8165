"""A client's fair share of the admission queue, over real servers on 127.0.0.1.

The client is the peer's address: 127.0.0.1 and 127.0.0.2 (both loopback on Linux) are
two clients, and the same address over HTTP and gRPC is one. The orchestrator (MockEngine:
first token = sum(prompt) mod 256, then +1 per step) starts only once the queue is as the
test wants it, so what is queued is exact.
"""

import threading

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
from tests.jetserve.test_orchestrator_mock import wait_until

SHARE = 3


def _post(port: int, body: dict, source: str = "127.0.0.1", timeout: float = 60):
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=timeout) as c:
        return c.post(f"http://127.0.0.1:{port}/v1/completions", json=body)


def _in_background(fn, *args):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=fn(*args)), daemon=True)
    t.start()
    return t, out


def test_a_client_beyond_its_share_gets_429_on_both_protocols_while_others_get_in():
    engine = MockEngine(max_concurrent_decodes=2, max_prefill_length=64, max_seq_len=128,
                        devices=jax.devices()[:1])
    orch = Orchestrator.from_engines(engine, config=OrchestratorConfig(
        max_queued_requests=2 * SHARE, max_queued_per_client=SHARE))
    body = {"prompt": [5], "max_tokens": 2, "temperature": 0}
    try:
        with BackgroundServers(orch, local_config()) as s:
            # Client 127.0.0.1 fills its share with one request of 3 samples (not started:
            # they wait in the queue).
            a, a_out = _in_background(_post, s.http_port, {**body, "n": SHARE})
            wait_until(lambda: orch.stats()["admission_queue"] == SHARE, timeout=60)
            refused = _post(s.http_port, body)
            assert refused.status_code == 429, refused.text
            assert "client's share" in refused.json()["error"]["message"]
            with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
                with pytest.raises(grpc.RpcError) as e:
                    list(pb_grpc.OrchestratorStub(ch).Decode(pb.DecodeRequest(
                        max_tokens=2, token_content=pb.DecodeRequest.TokenContent(
                            token_ids=[5])), timeout=60))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "client's share" in e.value.details()
            too_big = _post(s.http_port, {**body, "n": SHARE + 1}, source="127.0.0.3")
            assert too_big.status_code == 400  # more than any client may queue
            assert f"at most {SHARE} per client" in too_big.json()["error"]["message"]
            # Another address is another client: it still gets in.
            b, b_out = _in_background(_post, s.http_port, {**body, "n": SHARE}, "127.0.0.2")
            wait_until(lambda: orch.stats()["admission_queue"] == 2 * SHARE, timeout=60)
            assert orch.stats()["admission_clients"] == 2
            orch.start()
            for t in (a, b):
                t.join(timeout=60)
            for out in (a_out, b_out):
                assert out["r"].status_code == 200, out["r"].text
                choices = out["r"].json()["choices"]
                assert [c["text"] for c in choices] == ["\x05\x06"] * SHARE
    finally:
        orch.stop(drain=False, timeout=30)

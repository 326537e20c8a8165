"""API keys on both servers (missing / wrong rejected, right served in either header),
both servers over TLS, and a second server on a taken port failing instead of sharing it."""

import dataclasses
import ssl

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jetserve.server.runner import BackgroundServers
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_MODEL, local_config
from tests.e2e.tls_cert import self_signed

KEY = "s3cret-key"
REQUEST = pb.DecodeRequest(max_tokens=3, has_bos=True, ignore_eos=True,
                           token_content=pb.DecodeRequest.TokenContent(token_ids=[65, 66]))


@pytest.fixture(scope="module")
def keyed(tiny_orch):
    with BackgroundServers(tiny_orch, local_config(api_key=KEY)) as s:
        yield s


def _decode(stub, metadata):
    return list(stub.Decode(REQUEST, metadata=metadata, timeout=60))


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),),
                                      (("x-api-key", "wrong"),),
                                      (("authorization", KEY),)],  # no Bearer scheme
                         ids=["missing", "wrong bearer", "wrong x-api-key", "no scheme"])
def test_grpc_rejects_missing_or_wrong_key(keyed, metadata):
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            _decode(stub, metadata)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.HealthCheck(pb.HealthCheckRequest(), metadata=metadata, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("metadata", [(("authorization", f"Bearer {KEY}"),),
                                      (("authorization", f"bearer {KEY}"),),
                                      (("x-api-key", KEY),)],
                         ids=["bearer", "lower-case bearer", "x-api-key"])
def test_grpc_serves_the_right_key(keyed, metadata):
    with grpc.insecure_channel(f"127.0.0.1:{keyed.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)
        msgs = _decode(stub, metadata)
        assert sum(len(m.stream_content.samples[0].token_ids) for m in msgs) == 3
        # The standard health service stays open for probes.
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest()).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_http_rejects_missing_or_wrong_key(keyed):
    base = f"http://127.0.0.1:{keyed.http_port}"
    body = {"model": TINY_MODEL, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"x-api-key": "wrong"}, {"Authorization": "Basic " + KEY}):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 401
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=TINY_MODEL, prompt="hi", max_tokens=2)
    assert httpx.get(f"{base}/health").status_code == 200  # probes need no key


def test_http_serves_the_right_key(keyed):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed.http_port}/v1", api_key=KEY,
                           max_retries=0, timeout=60)
    r = client.completions.create(model=TINY_MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
    r = client.chat.completions.create(model=TINY_MODEL, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("headers", [{"x-api-key": KEY}, {"Authorization": f"bearer {KEY}"},
                                     {"Authorization": f"BEARER {KEY}"}],
                         ids=["x-api-key", "lower-case bearer", "upper-case bearer"])
def test_http_accepts_either_header(keyed, headers):
    r = httpx.get(f"http://127.0.0.1:{keyed.http_port}/v1/models", headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == TINY_MODEL


@pytest.mark.parametrize("which", ["grpc", "http"])
def test_a_second_server_on_a_taken_port_fails_naming_it(tiny_orch, keyed, which):
    port = keyed.grpc_port if which == "grpc" else keyed.http_port
    ports = dict(grpc_port=port, http_port=None) if which == "grpc" else dict(http_port=port,
                                                                               grpc_port=None)
    config = dataclasses.replace(local_config(api_key="impostor"), **ports)
    impostor = BackgroundServers(tiny_orch, config)
    try:
        name = "gRPC" if which == "grpc" else "HTTP"
        with pytest.raises(ValueError,  # PortUnavailable: the CLI's one line, exit 2
                           match=f"^{name} port {port} on 127.0.0.1 is already in use$"):
            impostor.start()
    finally:
        impostor.stop()
    # Every new connection still reaches the first server: the impostor, which would
    # refuse KEY, never listened (a shared port would hand it about half of them).
    for _ in range(20):
        if which == "grpc":
            # A channel of its own: no connection shared with the other channels.
            with grpc.insecure_channel(f"127.0.0.1:{port}",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                pb_grpc.OrchestratorStub(ch).HealthCheck(
                    pb.HealthCheckRequest(), metadata=(("x-api-key", KEY),), timeout=60)
        else:
            with httpx.Client(timeout=60) as client:  # a fresh connection each time
                r = client.get(f"http://127.0.0.1:{port}/v1/models",
                               headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 200


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_servers(tiny_orch, cert):
    crt, key = cert
    with BackgroundServers(tiny_orch, local_config(tls_cert=crt, tls_key=key,
                                                   api_key=KEY)) as s:
        yield s


def test_grpc_over_tls(tls_servers, cert):
    crt, _ = cert
    s = tls_servers
    with open(crt, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    with grpc.secure_channel(f"localhost:{s.grpc_port}", creds) as ch:
        msgs = _decode(pb_grpc.OrchestratorStub(ch), (("x-api-key", KEY),))
        assert sum(len(m.stream_content.samples[0].token_ids) for m in msgs) == 3
    with grpc.insecure_channel(f"localhost:{s.grpc_port}") as ch:  # plaintext refused
        with pytest.raises(grpc.RpcError):
            _decode(pb_grpc.OrchestratorStub(ch), (("x-api-key", KEY),))


def test_http_over_tls(tls_servers, cert):
    crt, _ = cert
    base = f"https://localhost:{tls_servers.http_port}"
    body = {"model": TINY_MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True}
    with httpx.Client(verify=ssl.create_default_context(cafile=crt), timeout=60) as client:
        r = client.post(f"{base}/v1/completions", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        r = client.post(f"{base}/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        oa = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0,
                           http_client=client)
        assert oa.models.list().data[0].id == TINY_MODEL
    # The key never crosses in clear: plain HTTP gets no answer from the TLS port.
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://localhost:{tls_servers.http_port}/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)

"""The JetStream-compatible gRPC server, called through a stub generated from the .proto."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc

TokenContent = pb.DecodeRequest.TokenContent
TextContent = pb.DecodeRequest.TextContent
PROMPT_IDS = [72, 101, 108, 108, 111, 32, 119]


@pytest.fixture(scope="module")
def channel(tiny_servers):
    with grpc.insecure_channel(f"127.0.0.1:{tiny_servers.grpc_port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.OrchestratorStub(channel)


def decode(stub, **kw) -> list[pb.DecodeResponse]:
    return list(stub.Decode(pb.DecodeRequest(**kw), timeout=120))


def test_health_check(stub, channel):
    assert stub.HealthCheck(pb.HealthCheckRequest()).is_live
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "jetstream_proto.Orchestrator"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    services = db.get_services()
    assert "jetstream_proto.Orchestrator" in services
    assert "grpc.health.v1.Health" in services
    desc = db.FindFileContainingSymbol("jetstream_proto.Orchestrator")
    assert desc.package == "jetstream_proto"


def _reflect_v1(channel, **request) -> list:
    """One request to grpc.reflection.v1, as a client that speaks only v1 sends it. v1's
    messages are v1alpha's under another package name, field for field, so v1alpha's
    classes write and read v1's bytes exactly."""
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2 as wire

    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=wire.ServerReflectionRequest.SerializeToString,
        response_deserializer=wire.ServerReflectionResponse.FromString)
    (resp,) = list(call(iter([wire.ServerReflectionRequest(**request)]), timeout=60))
    assert resp.WhichOneof("message_response") != "error_response", resp.error_response
    if resp.HasField("list_services_response"):
        return [s.name for s in resp.list_services_response.service]
    files = []
    for raw in resp.file_descriptor_response.file_descriptor_proto:
        files.append(descriptor_pb2.FileDescriptorProto.FromString(raw))
    return files


def test_reflection_v1_for_clients_that_speak_only_v1(channel):
    services = _reflect_v1(channel, list_services="")
    assert {"jetstream_proto.Orchestrator", "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    (desc,) = _reflect_v1(channel, file_containing_symbol="jetstream_proto.Orchestrator")
    assert desc.package == "jetstream_proto"
    methods = {m.name for s in desc.service for m in s.method}
    assert {"Decode", "HealthCheck"} <= methods
    # The v1 service describes itself under its own package, as v1 clients resolve it.
    (own,) = _reflect_v1(channel, file_containing_symbol="grpc.reflection.v1.ServerReflection")
    assert own.package == "grpc.reflection.v1"
    (method,) = [m for s in own.service for m in s.method]
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert method.client_streaming and method.server_streaming


def test_one_message_per_token_like_jetstream(stub):
    msgs = decode(stub, max_tokens=10, token_content=TokenContent(token_ids=PROMPT_IDS),
                  has_bos=True, ignore_eos=True)
    assert len(msgs) == 10
    for m in msgs:
        assert m.WhichOneof("content") == "stream_content"
        assert len(m.stream_content.samples) == 1
        assert len(m.stream_content.samples[0].token_ids) == 1
    assert msgs[-1].stream_content.samples[0].finish_reason == "length"


def test_text_and_token_content_agree(stub):
    by_ids = decode(stub, max_tokens=8, token_content=TokenContent(token_ids=PROMPT_IDS),
                    has_bos=True, ignore_eos=True)
    by_text = decode(stub, max_tokens=8, text_content=TextContent(text=bytes(PROMPT_IDS).decode()),
                     ignore_eos=True)  # random:tiny has no BOS, so has_bos does not matter
    ids = lambda ms: [t for m in ms for t in m.stream_content.samples[0].token_ids]
    assert ids(by_ids) == ids(by_text)
    text = "".join(m.stream_content.samples[0].text for m in by_text)
    assert text == bytes(ids(by_text)).decode("utf-8", errors="replace")


def test_stop_token_comes_alone_with_empty_text(stub):
    first = decode(stub, max_tokens=12, token_content=TokenContent(token_ids=PROMPT_IDS),
                   has_bos=True, ignore_eos=True)
    ids = [m.stream_content.samples[0].token_ids[0] for m in first]
    k = 5
    stop = ids[k]
    k = ids.index(stop)  # its first occurrence
    msgs = decode(stub, max_tokens=12, token_content=TokenContent(token_ids=PROMPT_IDS),
                  has_bos=True, ignore_eos=True, stop_token_ids=[stop])
    got = [list(m.stream_content.samples[0].token_ids) for m in msgs]
    assert sum(got, []) == ids[: k + 1]
    last = msgs[-1].stream_content.samples[0]
    assert list(last.token_ids) == [stop] and last.text == "" and last.finish_reason == "stop"


def test_num_samples_seeded_sampling(stub):
    kw = dict(max_tokens=12, token_content=TokenContent(token_ids=PROMPT_IDS), has_bos=True,
              ignore_eos=True, num_samples=3, temperature=1.0, seed=7)
    runs = []
    for _ in range(2):
        msgs = decode(stub, **kw)
        assert all(len(m.stream_content.samples) == 3 for m in msgs)
        runs.append([[t for m in msgs for t in m.stream_content.samples[i].token_ids]
                     for i in range(3)])
    assert runs[0] == runs[1]  # same seed: same samples
    assert all(len(s) == 12 for s in runs[0])
    assert len({tuple(s) for s in runs[0]}) == 3  # each sample draws differently


def test_logprobs_extension(stub):
    msgs = decode(stub, max_tokens=4, token_content=TokenContent(token_ids=PROMPT_IDS),
                  has_bos=True, ignore_eos=True, logprobs=3)
    for m in msgs:
        s = m.stream_content.samples[0]
        assert len(s.logprobs) == len(s.token_ids) == 1
        assert len(s.top_logprobs) == 1 and len(s.top_logprobs[0].alternatives) == 3
        best = s.top_logprobs[0].alternatives[0]
        # greedy: the chosen token is the most likely one
        assert best.token_id == s.token_ids[0]
        assert abs(best.logprob - s.logprobs[0]) < 1e-5

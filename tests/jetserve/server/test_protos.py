"""The committed generated code matches protos/jetstream.proto, and the wire numbers are
JetStream's (so JetStream's own clients keep working)."""

import os
import re
import subprocess
import sys

import pytest

from protos import jetstream_pb2 as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
GENERATED = tuple(f"{proto}{suffix}" for proto in ("jetstream", "prefill_worker")
                  for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))

# Lines that only record which protoc / grpcio-tools produced the file.
_VERSION_LINE = re.compile(
    r"Protobuf Python Version|GRPC_GENERATED_VERSION = |^\s*\d+,\s*$|^\s*'',\s*$")


def _normalized(path: str) -> list[str]:
    with open(path) as f:
        return [line for line in f.read().splitlines() if not _VERSION_LINE.search(line)]


def test_generated_code_is_up_to_date(tmp_path):
    pytest.importorskip("grpc_tools")
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "gen_protos.sh"), str(tmp_path)],
                   check=True, env=env)
    for name in GENERATED:
        fresh = _normalized(str(tmp_path / "protos" / name))
        committed = _normalized(os.path.join(ROOT, "protos", name))
        assert fresh == committed, f"protos/{name} is stale: run scripts/gen_protos.sh"


def _numbers(message) -> dict[str, int]:
    return {f.name: f.number for f in message.DESCRIPTOR.fields}


def test_jetstream_field_numbers():
    req = _numbers(pb.DecodeRequest)
    assert {k: req[k] for k in ("max_tokens", "text_content", "token_content", "metadata",
                                "num_samples", "lora_adapter_id", "has_bos")} == {
        "max_tokens": 4, "text_content": 5, "token_content": 6, "metadata": 7,
        "num_samples": 8, "lora_adapter_id": 9, "has_bos": 10}
    # Our extensions never reuse JetStream's numbers.
    assert all(n >= 11 for name, n in req.items() if name not in (
        "max_tokens", "text_content", "token_content", "metadata", "num_samples",
        "lora_adapter_id", "has_bos"))
    assert _numbers(pb.DecodeRequest.TextContent) == {"text": 1}
    assert _numbers(pb.DecodeRequest.TokenContent) == {"token_ids": 1}
    oneof = pb.DecodeRequest.DESCRIPTOR.oneofs_by_name["content"]
    assert {f.name for f in oneof.fields} == {"text_content", "token_content"}
    resp = _numbers(pb.DecodeResponse)
    assert resp == {"initial_content": 2, "stream_content": 3}
    assert _numbers(pb.DecodeResponse.StreamContent) == {"samples": 1}
    sample = _numbers(pb.DecodeResponse.StreamContent.Sample)
    assert sample["text"] == 1 and sample["token_ids"] == 2
    assert _numbers(pb.HealthCheckResponse) == {"is_live": 1}
    assert pb.DESCRIPTOR.package == "jetstream_proto"
    svc = pb.DESCRIPTOR.services_by_name["Orchestrator"]
    assert svc.methods_by_name["Decode"].server_streaming
    assert not svc.methods_by_name["HealthCheck"].server_streaming


def test_jetstream_encoding_round_trips():
    # Bytes a JetStream client would send for token input (field 6) and max_tokens (4).
    wire = bytes([0x20, 0x05, 0x32, 0x03, 0x0A, 0x01, 0x07])
    req = pb.DecodeRequest.FromString(wire)
    assert req.max_tokens == 5 and list(req.token_content.token_ids) == [7]
    assert not req.HasField("temperature")

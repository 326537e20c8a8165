"""JetStream's own client stubs (the `google-jetstream` package's generated
`jetstream_pb2` / `jetstream_pb2_grpc`, not ours) against the running gRPC server: the
streams they read, message by message, equal what our own stubs read for the same greedy
request, for text and token content, and EOS arrives as JetStream sends it (the stop id
in `token_ids`, empty text). The client runs in its own process (jetstream_requester.py
says why)."""

import importlib.util
import json
import os
import subprocess
import sys

import grpc
import pytest

from jetserve.model_loading import BUNDLED_DIR
from jetserve.tokenizer import load_tokenizer
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc

# The package's declared dependencies pull seqio and tensorflow; its stubs need only the
# grpcio and protobuf we install, so README and .ci/run install it without them.
INSTALL = ".venv/bin/pip install --no-deps google-jetstream==0.2.2"
REQUESTER = os.path.join(os.path.dirname(__file__), "jetstream_requester.py")
PROMPTS = ["def add(a, b):\n    ", "import os\n\n\nclass Path:\n    def", "    # 東京 🙂 é\n"]
# random:tiny prompts, one of which greedy ends with EOS within EOS_MAX_TOKENS.
EOS_CANDIDATES = ["xyz", "Hello w", "def f", "abc", "The", "print", "1 2 3", "a"]
EOS_MAX_TOKENS = 48


def _has_jetstream_stubs() -> bool:
    # find_spec imports only the (empty) parent packages, never JetStream's jetstream_pb2,
    # which would collide with ours in this process's descriptor pool.
    try:
        return importlib.util.find_spec("jetstream.core.proto.jetstream_pb2") is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(
    not _has_jetstream_stubs(),
    reason=f"google-jetstream is not installed; install it with: {INSTALL}")


def _jetstream_client(port: int, requests: list[dict]) -> dict:
    out = subprocess.run([sys.executable, REQUESTER, f"127.0.0.1:{port}", json.dumps(requests)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _our_stream(port: int, spec: dict) -> list[pb.DecodeResponse.StreamContent.Sample]:
    """The same request through our stubs, with only JetStream's fields set."""
    if "text" in spec:
        content = {"text_content": pb.DecodeRequest.TextContent(text=spec["text"])}
    else:
        content = {"token_content": pb.DecodeRequest.TokenContent(token_ids=spec["token_ids"])}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        msgs = pb_grpc.OrchestratorStub(ch).Decode(
            pb.DecodeRequest(max_tokens=spec["max_tokens"], **content), timeout=300)
        return [m.stream_content.samples[0] for m in msgs]


def _pairs(samples) -> list[list]:
    return [[s.text, list(s.token_ids)] for s in samples]


def test_jetstream_stubs_stream_what_ours_do_text_and_tokens(bundled_servers):
    tok = load_tokenizer(BUNDLED_DIR)
    # JetStream's request has no has_bos: token content comes without BOS and the server
    # prepends it, as it does to text content, so both kinds ask for the same tokens.
    specs = [{"max_tokens": 24, "text": p} for p in PROMPTS]
    specs += [{"max_tokens": 24, "token_ids": tok.encode(p, add_bos=False)} for p in PROMPTS]
    port = bundled_servers.grpc_port
    got = _jetstream_client(port, specs)
    assert got["is_live"] is True
    ours = [_pairs(_our_stream(port, s)) for s in specs]
    assert got["streams"] == ours
    by_text, by_ids = got["streams"][: len(PROMPTS)], got["streams"][len(PROMPTS):]
    assert by_text == by_ids
    for stream in by_text:
        assert len(stream) == 24 and all(len(ids) == 1 for _, ids in stream)
        ids = [i for _, token in stream for i in token]
        # requester.py joins the text pieces; they spell what the tokens decode to.
        assert "".join(text for text, _ in stream) == tok.decode(ids)


def test_jetstream_stubs_see_eos_as_jetstream_sends_it(tiny_servers, tiny_orch):
    """Greedy ends at EOS by itself (JetStream's request cannot ask for stop ids): the
    last message carries the EOS id alone, with empty text, in both clients."""
    eos_ids = set(tiny_orch.tokenizer.eos_ids)
    port = tiny_servers.grpc_port
    for prompt in EOS_CANDIDATES:
        spec = {"max_tokens": EOS_MAX_TOKENS, "text": prompt}
        ours = _our_stream(port, spec)
        if ours[-1].finish_reason == "stop":
            break
    else:
        pytest.fail(f"no prompt of {EOS_CANDIDATES} reached EOS in {EOS_MAX_TOKENS} tokens")
    assert len(ours) < EOS_MAX_TOKENS
    assert ours[-1].text == "" and len(ours[-1].token_ids) == 1
    assert ours[-1].token_ids[0] in eos_ids
    got = _jetstream_client(port, [spec])
    assert got["is_live"] is True
    (stream,) = got["streams"]
    assert stream == _pairs(ours)
    assert stream[-1] == ["", [ours[-1].token_ids[0]]]


def test_benchmark_serving_style_requests(bundled_servers):
    """benchmark_serving.py's request: client-side token ids with JetStream 0.2.2's
    `session_cache` and `priority` set (fields our proto reserves, so the server skips
    them), several in flight over grpc.aio: each streams the ids ours does without them."""
    tok = load_tokenizer(BUNDLED_DIR)
    ids = [tok.encode(p, add_bos=False) for p in PROMPTS]
    specs = [{"max_tokens": 16, "token_ids": t, "session_cache": "bench", "priority": 1,
              "aio": True} for t in ids]
    port = bundled_servers.grpc_port
    got = _jetstream_client(port, specs)
    for stream, t in zip(got["streams"], ids, strict=True):
        ours = _our_stream(port, {"max_tokens": 16, "token_ids": t})
        assert stream == [["", list(s.token_ids)] for s in ours]
        assert len(stream) == 16

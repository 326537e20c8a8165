"""A JetStream client, run as its own process by test_jetstream_client.py: it speaks only
through the `google-jetstream` package's own generated stubs, the way JetStream's
`tools/requester.py` does (one blocking `Decode` stream per request, reading
`stream_content.samples[0]` of each message).

Its own process because JetStream's `jetstream_pb2` and ours both register
`jetstream_proto.*` in protobuf's default descriptor pool, which refuses a symbol
defined twice: a real JetStream client never has our stubs loaded either.

    python tests/e2e/jetstream_requester.py HOST:PORT REQUESTS_JSON

REQUESTS_JSON is a list of {"max_tokens": N, "text": S} or {"max_tokens": N,
"token_ids": [...]}, optionally with JetStream 0.2.2's "session_cache" and "priority"
(fields our proto reserves) and "aio": true to stream as `benchmarks/benchmark_serving.py`'s
`grpc_async_request` does (an asyncio channel, token ids only). Prints one JSON object:
{"is_live": bool, "streams": [[[text, [ids]], ...one pair per message...], ...one per
request...]}; an aio stream's text is empty, as that client reads none.
"""

import asyncio
import json
import sys

import grpc
from jetstream.core.proto import jetstream_pb2, jetstream_pb2_grpc


def decode_request(spec: dict) -> jetstream_pb2.DecodeRequest:
    """JetStream's own request message: text or token content, nothing of ours."""
    if "text" in spec:
        content = {"text_content": jetstream_pb2.DecodeRequest.TextContent(text=spec["text"])}
    else:
        content = {"token_content": jetstream_pb2.DecodeRequest.TokenContent(
            token_ids=spec["token_ids"])}
    legacy = {k: spec[k] for k in ("session_cache", "priority") if k in spec}
    return jetstream_pb2.DecodeRequest(max_tokens=spec["max_tokens"], **content, **legacy)


def stream(stub, request) -> list[tuple[str, list[int]]]:
    """Each streamed message's first sample, as requester.py reads them."""
    return [(resp.stream_content.samples[0].text, list(resp.stream_content.samples[0].token_ids))
            for resp in stub.Decode(request, timeout=300)]


async def stream_aio(target: str, request) -> list[tuple[str, list[int]]]:
    """Token ids per message over a grpc.aio channel of its own, as benchmark_serving's
    `grpc_async_request` reads them. That module cannot be imported here (it imports
    seqio, so tensorflow, and tiktoken at the top), so this reads the stream the same way."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        return [("", list(resp.stream_content.samples[0].token_ids))
                async for resp in stub.Decode(request, timeout=300)]


async def stream_all_aio(target: str, specs: list[dict]) -> list[list[tuple[str, list[int]]]]:
    """All at once, as benchmark_serving keeps many requests in flight."""
    return await asyncio.gather(*(stream_aio(target, decode_request(s)) for s in specs))


def main(target: str, requests_json: str) -> None:
    with grpc.insecure_channel(target) as channel:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        is_live = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=60).is_live
        specs = json.loads(requests_json)
        aio = iter(asyncio.run(stream_all_aio(target, [s for s in specs if s.get("aio")])))
        streams = [next(aio) if s.get("aio") else stream(stub, decode_request(s))
                   for s in specs]
    print(json.dumps({"is_live": is_live, "streams": streams}))


if __name__ == "__main__":
    main(*sys.argv[1:])

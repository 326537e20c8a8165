"""32 concurrent streams through the disaggregated servers (prefill on 4 fake CPU devices,
generate on 4 others) give, stream by stream, what `jetserve generate` and the offline
lock-step loop give for the same prompt."""

import asyncio
import contextlib
import io
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jax
import openai
import pytest

from jetserve.cli import main as jetserve_main
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_ENGINE, TINY_MODEL

MAX_TOKENS = 12
# 32 distinct ASCII prompts, 3..49 bytes long (several prefill buckets).
PROMPTS = [f"{i}:" + "the quick brown fox jumps over the lazy dog"[: (i * 7) % 47]
           for i in range(32)]


@pytest.fixture(scope="module")
def offline_reference():
    """Token ids per prompt from the offline loop on one device (no orchestrator)."""
    engine = build_engine(TINY_MODEL, devices=jax.devices()[:1], engine_config=TINY_ENGINE)
    params = engine.load_params()
    results = generate_many(engine, params, [list(p.encode()) for p in PROMPTS],
                            max_tokens=MAX_TOKENS)
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def cli_reference():
    """`jetserve generate --json` for every prompt (run in this process)."""
    argv = ["generate", "--model", TINY_MODEL, "--json", "--max-tokens", str(MAX_TOKENS),
            "--devices", "1",
            "--max-concurrent-decodes", str(TINY_ENGINE.max_concurrent_decodes),
            "--max-prefill-length", str(TINY_ENGINE.max_prefill_length),
            "--max-seq-len", str(TINY_ENGINE.max_seq_len)]
    for p in PROMPTS:
        argv += ["--prompt", p]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert jetserve_main(argv) == 0
    rows = [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]
    assert [r["prompt_ids"] for r in rows] == [list(p.encode()) for p in PROMPTS]
    return rows


def test_cli_agrees_with_offline_loop(cli_reference, offline_reference):
    assert [r["token_ids"] for r in cli_reference] == offline_reference


def test_32_concurrent_grpc_streams(tiny_servers, cli_reference):
    with grpc.insecure_channel(f"127.0.0.1:{tiny_servers.grpc_port}") as ch:
        stub = pb_grpc.OrchestratorStub(ch)

        def one(prompt: str):
            req = pb.DecodeRequest(max_tokens=MAX_TOKENS,
                                   text_content=pb.DecodeRequest.TextContent(text=prompt))
            msgs = list(stub.Decode(req, timeout=300))
            return ([t for m in msgs for t in m.stream_content.samples[0].token_ids],
                    "".join(m.stream_content.samples[0].text for m in msgs))

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, PROMPTS))
    for (ids, text), want in zip(got, cli_reference, strict=True):
        assert ids == want["token_ids"]
        assert text == want["text"]


def test_32_concurrent_http_streams(tiny_servers, cli_reference):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_servers.http_port}/v1",
                                    api_key="unused", max_retries=0, timeout=300)

        async def one(prompt: str) -> tuple[str, str]:
            stream = await client.completions.create(model=TINY_MODEL, prompt=prompt,
                                                     max_tokens=MAX_TOKENS, temperature=0,
                                                     stream=True)
            text, finish = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return text, finish

        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await client.close()

    got = asyncio.run(run())
    for (text, finish), want in zip(got, cli_reference, strict=True):
        assert text == want["text"]
        assert finish == want["finish_reason"]

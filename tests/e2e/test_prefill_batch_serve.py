"""`jetserve serve --prefill-batch 4`: a real server on a real port, its warm-up compiling
the shared prefill calls, answering completions sent at once through the `openai` package
with the greedy text of an engine that prefills one prompt a call (in process)."""

import asyncio
import threading

import openai
import pytest

from engines import EngineConfig
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from jetserve.orchestrator.detokenize import completion_text
from tests.e2e.serve_process import spawn, wait_listening

SERVE = ["--model", "random:tiny", "--interleaved", "--max-seq-len", "96",
         "--max-prefill-length", "64", "--max-concurrent-decodes", "4", "--kv-layout", "paged",
         "--page-size", "8", "--prefill-batch", "4"]
PROMPTS = [[(5 * i + 7 * j) % 200 + 3 for j in range(n)] for i, n in
           enumerate((3, 12, 16, 7, 9, 1, 14, 5))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served():
    proc = spawn([*SERVE, "--host", "127.0.0.1", "--grpc-port", "-1", "--http-port", "0"])
    lines: list[str] = []
    port = wait_listening(proc, 1, lines=lines)["HTTP"]
    threading.Thread(target=lambda: list(proc.stdout), daemon=True).start()  # keep draining
    yield port, "".join(lines)
    proc.kill()
    proc.wait()


def test_warmup_compiles_the_shared_calls(served):
    _, log = served
    # 4 x 16 tokens and 2 x 32 fit one call's 64 tokens; the serve log names its plan.
    assert "prefill calls of 2 prompts x 16, 4 prompts x 16, 2 prompts x 32" in log


def test_completions_sent_at_once_equal_one_prompt_a_call(served):
    port, _ = served
    engine = build_engine("random:tiny", engine_config=EngineConfig(
        max_concurrent_decodes=1, max_prefill_length=64, max_seq_len=96))
    refs = generate_many(engine, engine.load_params(), PROMPTS, max_tokens=MAX_TOKENS,
                         ignore_eos=True)
    want = [completion_text(engine.tokenizer, p, r.token_ids, False)
            for p, r in zip(PROMPTS, refs, strict=True)]

    async def send_all():
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        try:
            outs = await asyncio.gather(*(client.completions.create(
                model="random:tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}) for p in PROMPTS))
        finally:
            await client.close()
        return [o.choices[0].text for o in outs]

    assert asyncio.run(send_all()) == want

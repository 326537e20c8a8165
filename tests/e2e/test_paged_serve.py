"""`jetserve serve` with a paged KV cache, chunked prefill and a prefix cache: a prompt
longer than max_prefill_length is served, twice (the second time from the cache), with
the text of an in-process contiguous engine, and /metrics shows the pages and the cache."""

import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engines import EngineConfig
from jetserve.model_loading import build_engine
from jetserve.offline import generate_many
from jetserve.orchestrator.detokenize import completion_text
from tests.xla import xla_flags

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(60)]  # 60 tokens: 4 chunks of 16
SERVE = ["--model", "random:tiny", "--interleaved", "--max-seq-len", "128",
         "--max-prefill-length", "32", "--max-concurrent-decodes", "4", "--kv-layout", "paged",
         "--page-size", "8", "--num-pages", "40", "--prefill-chunk", "16",
         "--prefix-cache-hbm-mb", "8"]


@pytest.fixture(scope="module")
def http_port():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(8))
    cmd = [sys.executable, "-m", "jetserve", "serve", *SERVE, "--host", "127.0.0.1",
           "--grpc-port", "-1", "--http-port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, port, ready = [], None, False
    deadline = time.monotonic() + 600
    while not ready and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"HTTP listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
        ready = "jetserve serve: ready" in line  # after the warm-up
    if port is None or not ready:
        proc.kill()
        pytest.fail("jetserve serve did not start:\n" + "".join(lines))
    threading.Thread(target=lambda: list(proc.stdout), daemon=True).start()  # keep draining
    yield port
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_long_prompt_twice_through_paged_chunked_cached_server(http_port):
    engine = build_engine("random:tiny", engine_config=EngineConfig(
        max_concurrent_decodes=1, max_prefill_length=64, max_seq_len=128))
    ref = generate_many(engine, engine.load_params(), [PROMPT], max_tokens=12,
                        ignore_eos=True)[0]
    want = completion_text(engine.tokenizer, PROMPT, ref.token_ids, False)
    base = f"http://127.0.0.1:{http_port}"
    rates = []
    with httpx.Client(timeout=300) as client:
        for _ in range(2):
            r = client.post(f"{base}/v1/completions", json={
                "model": "random:tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            metrics = client.get(f"{base}/metrics").text
            rate = re.search(r'jetserve_prefix_cache_hit_rate\{engine="0"\} ([0-9.]+)',
                             metrics)
            rates.append(float(rate.group(1)))
    # After a hits in n lookups (the warm-up's), the first long prompt missed: a / (n + 1);
    # the second hit: (a + 1) / (n + 2), higher whatever a <= n (a miss could only lower it).
    assert rates[1] > rates[0], rates
    # Every page is back, but those the prefix cache keeps (its device tier is the pool).
    cached = re.search(r'jetserve_prefix_cache_blocks\{engine="0",tier="hbm"\} ([0-9.]+)',
                       metrics)
    assert cached and float(cached.group(1)) >= 1
    assert f'jetserve_kv_pages_free{{engine="0"}} {40.0 - float(cached.group(1))}' in metrics

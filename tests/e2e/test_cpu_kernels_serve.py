"""Serving through the CPU kernels (engines/cpu_kernels.py): an orchestrator on one CPU
device runs its decode steps on them; over the OpenAI HTTP server, called with the `openai`
package, six concurrent greedy streams give the same text as the same model with the
kernels switched off."""

from concurrent.futures import ThreadPoolExecutor

import jax
import openai
import pytest

from engines import cpu_kernels
from jetserve import orchestrator
from jetserve.server.runner import BackgroundServers
from tests.e2e.conftest import TINY_ENGINE, TINY_MODEL, local_config

PROMPTS = ["def add(a, b):", "import os", "class Foo:", "for i in range(", "return", "# x"]


def _texts(switch: str, monkeypatch) -> tuple[list[str], int]:
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, switch)
    orch = orchestrator.build(TINY_MODEL, devices=jax.devices()[:1], engine_config=TINY_ENGINE)
    rows = orch.generate_engines[0].backend.cpu_matmul_rows
    orch.start()
    try:
        with BackgroundServers(orch, local_config()) as s:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.http_port}/v1", api_key="-")

            def stream(prompt: str) -> str:
                chunks = client.completions.create(model=TINY_MODEL, prompt=prompt,
                                                   max_tokens=40, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
                return "".join(c.choices[0].text for c in chunks)

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                return list(pool.map(stream, PROMPTS)), rows
    finally:
        orch.stop(drain=False, timeout=30)


def test_streams_through_the_kernels_equal_xla(monkeypatch):
    if not cpu_kernels.available():
        pytest.skip("the CPU kernels need x86-64 with AVX2 and FMA and a C++ compiler")
    on, rows_on = _texts("1", monkeypatch)
    off, rows_off = _texts("0", monkeypatch)
    assert rows_on == cpu_kernels.MAX_ROWS and rows_off == 0
    assert all(len(t) > 0 for t in on)
    assert on == off

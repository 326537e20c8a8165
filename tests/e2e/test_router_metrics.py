"""What routers and gateways read from a replica: /metrics under vLLM's and JetStream's
names (every row of docs/ROUTERS.md's table, parsed with prometheus_client's own parser),
/readiness, /liveness and /get_load, and a SIGTERM drain that answers 503 on health
while it still takes requests, then lets in-flight ones finish."""

import dataclasses
import os
import re
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jetserve.server.runner import BackgroundServers
from tests.e2e.conftest import TINY_MODEL, local_config

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "ROUTERS.md")


def documented_metrics() -> list[tuple[str, str, set[str]]]:
    """(name, type, labels) of every row of the doc's metrics table."""
    text = open(DOC).read()
    table = text.split("<!-- metrics-table")[1].split("<!-- end metrics-table")[0]
    rows = []
    for line in table.splitlines():
        m = re.match(r"\|\s*`([^`]+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            labels = {s.strip() for s in m.group(3).split(",") if s.strip()}
            rows.append((m.group(1), m.group(2), labels))
    return rows


def _families(port: int) -> dict:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _family_of(families: dict, name: str, kind: str):
    # The parser names a counter's family without its _total suffix (OpenMetrics style).
    base = name.removesuffix("_total") if kind == "counter" else name
    return families.get(base)


def _value(families: dict, name: str, kind: str = "counter", sample: str = "") -> float:
    fam = _family_of(families, name, kind)
    return sum(s.value for s in fam.samples if s.name == (sample or name))


def test_every_documented_metric_is_exported_with_its_type_and_labels(tiny_servers):
    rows = documented_metrics()
    assert len(rows) >= 15, rows  # the table was found and parsed
    port = tiny_servers.http_port
    before = _families(port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    out = client.completions.create(model=TINY_MODEL, prompt="count these tokens",
                                    max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    families = _families(port)
    for name, kind, labels in rows:
        fam = _family_of(families, name, kind)
        assert fam is not None, f"{name} missing from /metrics"
        assert fam.type == kind, (name, fam.type)
        samples = [s for s in fam.samples if s.name in (name, f"{name}_bucket")]
        assert samples, f"{name} has no sample"
        for s in samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)
            if "model_name" in labels:
                assert s.labels["model_name"] == TINY_MODEL
    # The counters count this request (the session server may serve others meanwhile, so
    # at least), and the gauges say the server is idle again.
    for name, n in (("vllm:prompt_tokens_total", out.usage.prompt_tokens),
                    ("vllm:generation_tokens_total", out.usage.completion_tokens)):
        assert _value(families, name) - _value(before, name) >= n
    ttft = ("vllm:time_to_first_token_seconds", "histogram",
            "vllm:time_to_first_token_seconds_count")
    assert _value(families, *ttft) >= _value(before, *ttft) + 1
    assert _value(families, "vllm:num_requests_running", "gauge") == 0
    assert _value(families, "vllm:kv_cache_usage_perc", "gauge") == 0
    (info,) = _family_of(families, "vllm:lora_requests_info", "gauge").samples
    assert info.labels == {"max_lora": "0", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}


def test_probes_and_load(tiny_servers):
    base = f"http://127.0.0.1:{tiny_servers.http_port}"
    assert httpx.get(f"{base}/readiness").status_code == 200
    assert httpx.get(f"{base}/liveness").json() == {"status": "alive"}
    assert httpx.get(f"{base}/get_load").json() == {"load": 0}  # vllm-router's shape


def test_get_load_in_sglang_routers_shape(tiny_orch):
    with BackgroundServers(tiny_orch, local_config(grpc_port=None, load_format="sglang")) as s:
        (load,) = httpx.get(f"http://127.0.0.1:{s.http_port}/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_warming_up_is_alive_but_not_ready(tiny_orch):
    with BackgroundServers(tiny_orch, local_config(grpc_port=None), warming=True) as s:
        base = f"http://127.0.0.1:{s.http_port}"
        assert httpx.get(f"{base}/liveness").status_code == 200
        assert httpx.get(f"{base}/readiness").status_code == 503
        s.ready()
        assert httpx.get(f"{base}/readiness").status_code == 200


def test_drain_answers_503_on_health_before_closing_and_finishes_in_flight(tiny_orch):
    config = dataclasses.replace(local_config(grpc_port=None), drain_notice_s=3.0)
    servers = BackgroundServers(tiny_orch, config).start()
    base = f"http://127.0.0.1:{servers.http_port}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    stream = client.completions.create(model=TINY_MODEL, prompt="in flight", max_tokens=60,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)  # the request is running
    stopper = threading.Thread(target=servers.stop)
    stopper.start()
    try:
        status = 200
        deadline = time.monotonic() + 60
        while status == 200 and time.monotonic() < deadline:
            status = httpx.get(f"{base}/health").status_code
        assert status == 503  # draining, and the socket still answers
        assert httpx.get(f"{base}/readiness").json() == {"status": "draining"}
        # Still taking requests during the notice (a router may not have seen it yet).
        late = client.completions.create(model=TINY_MODEL, prompt="late", max_tokens=2,
                                         temperature=0)
        assert late.choices[0].finish_reason == "length"
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert rest[-1].choices[0].finish_reason == "length" and text
    finally:
        stopper.join(120)
    assert not stopper.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/health")

"""Three jetserve replicas behind the routers people run, installed as packages:
vllm-router (round_robin, power_of_two, cache_aware, kv_aware fed by jetserve's KV
events) and sglang-router (cache_aware). The openai SDK through each router gets the
replicas' greedy answers; with kv_aware, prompts sharing a long prefix go to the replica
holding it (its prefix-cache hits on its /metrics); a replica killed between requests
costs no request, and takes requests again once it is back on its port.

Replicas: random:tiny, paged KV of 16-token pages (the routers' default KV block), a
prefix cache, KV events on 127.0.0.1 with vLLM's default topic "" (vllm-router's static
event sources subscribe to that topic only).
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_process import spawn, wait_listening

pytestmark = pytest.mark.slow

MODEL = "random:tiny"
BIN = os.path.dirname(sys.executable)
VLLM_ROUTER, SGLANG_ROUTER = (os.path.join(BIN, n) for n in ("vllm-router", "sglang-router"))
PROMPTS = ["route me", "three replicas", "the same greedy tokens"]
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replica_argv(http_port: int, events_port: int) -> list[str]:
    kv = {"enable_kv_cache_events": True, "publisher": "zmq",
          "endpoint": f"tcp://127.0.0.1:{events_port}", "topic": ""}
    return ["--model", MODEL, "--devices", "1", "--max-seq-len", "256",
            "--max-prefill-length", "128", "--max-concurrent-decodes", "4",
            "--kv-layout", "paged", "--page-size", "16", "--prefix-cache-hbm-mb", "8",
            "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "-1",
            "--no-warmup", "--drain-timeout", "5", "--kv-events-config", json.dumps(kv)]


class Replica:
    def __init__(self):
        self.http_port, self.events_port = _free_port(), _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def start(self) -> None:
        self.proc = spawn(_replica_argv(self.http_port, self.events_port))

    def wait(self) -> None:
        wait_listening(self.proc, 1)
        drain = self.proc.stdout  # keep the pipe drained
        threading.Thread(target=lambda: list(drain), daemon=True).start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name)


@pytest.fixture(scope="module")
def replicas():
    if not (os.path.exists(VLLM_ROUTER) and os.path.exists(SGLANG_ROUTER)):
        pytest.fail("vllm-router and sglang-router come with the test extra: "
                    "pip install -e '.[test]'")
    reps = [Replica() for _ in range(3)]
    try:
        for r in reps:
            r.start()
        for r in reps:
            r.wait()
        yield reps
    finally:
        for r in reps:
            r.kill()


@pytest.fixture(scope="module")
def reference(replicas) -> list[str]:
    """Each prompt's greedy text straight from one replica."""
    client = openai.OpenAI(base_url=f"{replicas[0].url}/v1", api_key="unused", timeout=300)
    return [_complete(client, p) for p in PROMPTS]


def _complete(client: openai.OpenAI, prompt) -> str:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].text


@contextlib.contextmanager
def router(kind: str, policy: str, replicas: list[Replica], *extra: str):
    """A router on 127.0.0.1 in front of `replicas`; yields its base URL."""
    port, prom = _free_port(), _free_port()
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(prom), "--worker-urls", *[r.url for r in replicas],
              "--policy", policy, "--worker-startup-check-interval", "1",
              "--health-check-interval-secs", "1", "--log-level", "warning", *extra]
    cmd = [VLLM_ROUTER, *common] if kind == "vllm" else \
        [SGLANG_ROUTER, "launch", *[a if a != "warning" else "warn" for a in common]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/v1/models", timeout=10).status_code == 200:
                    break
            time.sleep(0.3)
        else:
            proc.kill()
            pytest.fail(f"{kind}-router --policy {policy} did not start:\n"
                        + proc.stdout.read()[-3000:])
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=300, max_retries=0)


def _kv_aware(replicas: list[Replica]) -> list[str]:
    out = ["--kv-event-model", MODEL]
    for r in replicas:
        out += ["--kv-event-source", f"{r.url}={r.events}"]
    return out


POLICIES = [("vllm", "round_robin"), ("vllm", "power_of_two"), ("vllm", "cache_aware"),
            ("vllm", "kv_aware"), ("sglang", "cache_aware")]


@pytest.mark.parametrize("kind,policy", POLICIES, ids=[f"{k}-{p}" for k, p in POLICIES])
def test_the_openai_sdk_through_the_router_gets_the_replicas_greedy_answers(
        replicas, reference, kind, policy):
    extra = _kv_aware(replicas) if policy == "kv_aware" else []
    with router(kind, policy, replicas, *extra) as base:
        client = _client(base)
        got = [_complete(client, p) for p in PROMPTS * 2]  # spread over the replicas
        assert got == reference * 2
        if kind == "vllm" and policy == "power_of_two":
            # The router read every replica's /get_load (-1 is its "could not read").
            loads = httpx.get(f"{base}/get_loads", timeout=30).json()["workers"]
            assert len(loads) == 3 and all(w["load"] >= 0 for w in loads), loads


def _served_by(replicas: list[Replica], send) -> int:
    """Which replica prefilled what `send()` sent (its prefix-cache lookups grew)."""
    before = [r.metric("vllm:prefix_cache_queries_total") for r in replicas]
    send()
    grew = [i for i, r in enumerate(replicas)
            if r.metric("vllm:prefix_cache_queries_total") > before[i]]
    assert len(grew) == 1, grew
    return grew[0]


def test_kv_aware_sends_a_shared_prefix_to_the_replica_holding_it(replicas):
    prefix = [(7 * i) % 200 + 20 for i in range(97)]  # 6 whole 16-token blocks, and more
    with router("vllm", "kv_aware", replicas, *_kv_aware(replicas)) as base:
        client = _client(base)
        # Where the router sends a prompt nothing holds; the prefix then goes to another
        # replica, straight, so only its KV events can tell the router where it is.
        usual = _served_by(replicas, lambda: _complete(client, [3] * 40))
        holder = (usual + 1) % 3
        _complete(_client(replicas[holder].url), prefix + [1])
        time.sleep(1)  # the router's subscriber takes the BlockStored events in
        hits = [r.metric("vllm:prefix_cache_hits_total") for r in replicas]
        for tail in ([2, 3], [4], [5, 6, 7]):
            assert _served_by(replicas, lambda t=tail: _complete(client, prefix + t)) == holder
        gained = [r.metric("vllm:prefix_cache_hits_total") - h
                  for r, h in zip(replicas, hits, strict=True)]
    # Every follow-up hit the 6 cached blocks, on the holder.
    assert gained[holder] == 3 * 96 and sum(gained) == gained[holder], (holder, gained)


def test_a_killed_replica_costs_no_request_and_is_used_again(replicas, reference):
    victim = replicas[2]
    with router("vllm", "round_robin", replicas) as base:
        client = _client(base)
        for p in PROMPTS:
            assert _complete(client, p) in reference
        victim.kill()  # between requests: none had started on it
        got = [_complete(client, p) for p in PROMPTS * 3]
        assert got == reference * 3
        victim.start()  # back on the same port
        victim.wait()
        before = victim.metric("vllm:request_success_total")
        deadline = time.monotonic() + 120
        while victim.metric("vllm:request_success_total") == before:
            assert time.monotonic() < deadline, "the router never sent to the replica again"
            assert _complete(client, PROMPTS[0]) == reference[0]
            time.sleep(0.2)

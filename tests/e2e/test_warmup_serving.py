"""Warm-up before serving: servers listening while warming up report NOT_SERVING / 503 with
what is still compiling and refuse requests; `ready()` turns them SERVING / 200. The
warm-up compiles every prefill bucket (and its prompt scoring), insert and generate, so
no request of any length compiles afterwards; `jetserve serve` prints what it compiled,
and a restart on the same compile cache reads every program back."""

import os
import signal
import subprocess
import sys
import threading

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engines import EngineConfig
from jetserve import warmup
from jetserve.model_loading import build_engine
from jetserve.orchestrator import Orchestrator, Request
from jetserve.server.runner import BackgroundServers
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.conftest import TINY_MODEL, local_config
from tests.e2e.serve_process import wait_listening

H = health_pb2.HealthCheckResponse


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                    timeout=30).status


def _decode(port: int) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = pb.DecodeRequest(max_tokens=2, token_content=pb.DecodeRequest.TokenContent(
            token_ids=[3, 4, 5]))
        try:
            list(pb_grpc.OrchestratorStub(ch).Decode(req, timeout=120))
        except grpc.RpcError as e:
            return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_warming_servers_refuse_until_ready(tiny_orch):
    with BackgroundServers(tiny_orch, local_config(), warming=True) as s:
        s.servers.readiness.plan(["prompt bucket 16", "prompt bucket 32"])
        s.servers.readiness.step_done()
        base = f"http://127.0.0.1:{s.http_port}"
        r = httpx.get(f"{base}/health", timeout=30)
        assert r.status_code == 503
        assert r.json() == {"status": "warming up", "compiling": ["prompt bucket 32"],
                            "done": 1, "total": 2}
        assert _health(s.grpc_port) == H.NOT_SERVING
        with grpc.insecure_channel(f"127.0.0.1:{s.grpc_port}") as ch:
            live = pb_grpc.OrchestratorStub(ch).HealthCheck(pb.HealthCheckRequest(), timeout=30)
        assert not live.is_live
        code, details = _decode(s.grpc_port)
        assert code == grpc.StatusCode.UNAVAILABLE and "warming up" in details
        r = httpx.post(f"{base}/v1/completions", timeout=30,
                       json={"prompt": [3, 4, 5], "max_tokens": 2})
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 503
        s.ready()
        assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
        assert _health(s.grpc_port) == H.SERVING
        assert _decode(s.grpc_port)[0] == grpc.StatusCode.OK
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"prompt": [3, 4, 5], "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_nothing_compiles_after_the_warm_up():
    engine = build_engine(TINY_MODEL, engine_config=EngineConfig(
        max_concurrent_decodes=2, max_prefill_length=64, max_seq_len=128))
    with Orchestrator.from_engines(engine, params=engine.load_params()) as orch:
        labels = []
        counted = warmup.run(orch, on_plan=labels.extend, progress=False)
        n = len(engine.prefill_buckets())
        assert labels == [f"prompt bucket {b}" for b in engine.prefill_buckets()]
        warm = engine.trace_counts()
        assert warm["prefill"] == warm["prompt_logprobs"] == warm["insert"] == n
        assert warm["generate"] == 1 and counted.programs > 0
        rng = np.random.default_rng(0)
        handles = [orch.submit(Request(prompt_ids=rng.integers(1, 90, size=int(L)).tolist(),
                                       max_tokens=3, prompt_logprobs=bool(L % 2)))
                   for L in rng.integers(1, 65, size=8)]
        assert all(h.result(300).finish_reason in ("length", "stop") for h in handles)
        assert engine.trace_counts() == warm


def test_a_paged_warm_up_covers_every_generate_width():
    engine = build_engine(TINY_MODEL, engine_config=EngineConfig(
        max_concurrent_decodes=2, max_prefill_length=64, max_seq_len=128, kv_layout="paged",
        page_size=8))
    with Orchestrator.from_engines(engine, params=engine.load_params()) as orch:
        warmup.run(orch, progress=False)
        warm = engine.trace_counts()
        assert warm["generate"] == len(engine.generate_widths())  # 1, 2, 4, 8, 16 pages
        handles = [orch.submit(Request(prompt_ids=[7] * L, max_tokens=4)) for L in (9, 17)]
        assert all(h.result(300).finish_reason == "length" for h in handles)
        assert engine.trace_counts() == warm


def _serve(cache: str) -> tuple[list[str], subprocess.Popen, dict[str, int]]:
    cmd = [sys.executable, "-m", "jetserve", "serve", "--model", TINY_MODEL, "--host",
           "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--max-seq-len", "128",
           "--max-prefill-length", "32", "--max-concurrent-decodes", "2",
           "--compile-cache", cache]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    lines: list[str] = []
    ports = wait_listening(proc, 2, lines=lines)
    return lines, proc, ports


def _stop(proc: subprocess.Popen) -> None:
    threading.Thread(target=lambda: list(proc.stdout), daemon=True).start()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(120) == 0


@pytest.mark.slow
def test_serve_listens_then_warms_up_then_serves_and_a_restart_reads_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    counts = []
    for _ in range(2):
        lines, proc, ports = _serve(cache)
        try:
            text = "".join(lines)
            order = [text.index(s) for s in ("listening on", "warming up (2 steps",
                                              "compiled ", "jetserve serve: ready")]
            assert order == sorted(order), text
            (line,) = [x for x in lines if "compiled " in x]
            words = line.split()
            counts.append((int(words[3]), int(line.split("(")[-1].split()[0])))
            assert _health(ports["gRPC"]) == H.SERVING
            assert httpx.get(f"http://127.0.0.1:{ports['HTTP']}/health", timeout=30
                             ).status_code == 200
            assert _decode(ports["gRPC"])[0] == grpc.StatusCode.OK
        finally:
            _stop(proc)
    (cold_n, cold_hits), (warm_n, warm_hits) = counts
    assert cold_n > 0 and cold_hits == 0
    assert warm_hits == warm_n == cold_n  # the restart compiled nothing


@pytest.mark.slow
def test_sigterm_during_the_warm_up_stops_cleanly(tmp_path):
    cmd = [sys.executable, "-m", "jetserve", "serve", "--model", TINY_MODEL, "--host",
           "127.0.0.1", "--grpc-port", "0", "--http-port", "0", "--max-seq-len", "128",
           "--compile-cache", str(tmp_path / "cache")]  # empty: the warm-up compiles
    proc = subprocess.Popen(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    hung = threading.Timer(600, proc.kill)  # bounds the reads below
    hung.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "warming up" in line:
                break
        proc.send_signal(signal.SIGTERM)
        lines.extend(proc.stdout)
        assert proc.wait(120) == 0, "".join(lines)
    finally:
        hung.cancel()
    text = "".join(lines)
    assert "jetserve serve: ready" not in text and "jetserve serve: stopped" in text, text
    assert "Traceback" not in text, text

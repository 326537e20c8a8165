"""`jetserve serve` as a process: prints where it listens, serves both protocols
disaggregated, and on SIGTERM lets in-flight streams finish before it exits 0."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc

LONG = 240  # of max_seq_len 256: the streams outlast the SIGTERM by far


@pytest.fixture(scope="module")
def served():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    cmd = [sys.executable, "-m", "jetserve", "serve", "--model", "random:tiny",
           "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
           "--prefill-devices", "4", "--generate-devices", "4",
           "--max-seq-len", "256", "--max-prefill-length", "64"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, ports = [], {}
    deadline = time.monotonic() + 600
    while len(ports) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"(gRPC|HTTP) listening on (?:http://)?127\.0\.0\.1:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
    if len(ports) < 2:
        proc.kill()
        pytest.fail("jetserve serve did not start:\n" + "".join(lines))
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.extend(proc.stdout), daemon=True)
    reader.start()
    yield proc, ports, rest
    if proc.poll() is None:
        proc.kill()
    proc.wait()


@pytest.mark.slow
def test_sigterm_drains_in_flight_streams(served):
    proc, ports, rest = served
    got: dict[str, object] = {}
    started = {"grpc": threading.Event(), "http": threading.Event()}

    def grpc_stream():
        with grpc.insecure_channel(f"127.0.0.1:{ports['gRPC']}") as ch:
            stub = pb_grpc.OrchestratorStub(ch)
            req = pb.DecodeRequest(max_tokens=LONG, ignore_eos=True,
                                   text_content=pb.DecodeRequest.TextContent(text="drain me"))
            ids, finish = [], None
            for m in stub.Decode(req, timeout=300):
                started["grpc"].set()
                s = m.stream_content.samples[0]
                ids.extend(s.token_ids)
                finish = s.finish_reason or finish
            got["grpc"] = (len(ids), finish)

    def http_stream():
        body = {"prompt": "dm", "max_tokens": LONG, "stream": True, "ignore_eos": True}
        text_events, finish = 0, None
        with httpx.stream("POST", f"http://127.0.0.1:{ports['HTTP']}/v1/completions",
                          json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started["http"].set()
                    text_events += 1
                    finish = re.search(r'"finish_reason":"?(\w+)', line).group(1)
        got["http"] = (text_events, finish)

    threads = [threading.Thread(target=grpc_stream), threading.Thread(target=http_stream)]
    for t in threads:
        t.start()
    assert started["grpc"].wait(120) and started["http"].wait(120)
    assert not got  # both streams are mid-way
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(300)
    assert proc.wait(300) == 0
    assert got["grpc"] == (LONG, "length")  # every token arrived after SIGTERM
    assert got["http"] == (LONG, "length")
    assert any("draining" in line for line in rest), rest

"""`jetserve serve` as a process: prints where it listens, serves both protocols
disaggregated, and on SIGTERM lets in-flight streams finish before it exits 0; a taken
port ends it at once with one line; --api-key-file keeps the key off its command line;
--tls-cert serves both protocols over TLS."""

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading

import grpc
import httpx
import pytest

from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.e2e.serve_process import wait_listening
from tests.e2e.tls_cert import self_signed
from tests.xla import xla_flags

LONG = 240  # of max_seq_len 256: the streams outlast the SIGTERM by far


@pytest.fixture(scope="module")
def served():
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(8))
    cmd = [sys.executable, "-m", "jetserve", "serve", "--model", "random:tiny",
           "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
           "--prefill-devices", "4", "--generate-devices", "4",
           "--max-seq-len", "256", "--max-prefill-length", "64"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    ports = wait_listening(proc, 2)
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


def _listener(reuseport: bool) -> socket.socket:
    """A socket listening on a free 127.0.0.1 port; SO_REUSEPORT as a gRPC server sets it."""
    s = socket.socket()
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("flag", ["--grpc-port", "--http-port"])
def test_a_taken_port_exits_2_naming_it_before_the_model_loads(tmp_path, flag):
    other = "--http-port" if flag == "--grpc-port" else "--grpc-port"
    with _listener(reuseport=True) as held:
        port = held.getsockname()[1]
        # A model that is not there: had serve loaded it first, it would report the model.
        missing = str(tmp_path / "no-such-model")
        r = subprocess.run([sys.executable, "-m", "jetserve", "serve", "--model", missing,
                            "--host", "127.0.0.1", flag, str(port), other, "0"],
                           env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                           text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"jetserve serve: error: {flag} {port} on 127.0.0.1 is already in use\n"
    assert "listening" not in r.stdout


def test_api_key_file_keeps_the_key_out_of_argv(tmp_path):
    key = "file-key-7c1e"
    path = tmp_path / "key"
    path.write_text(f"  {key}\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JETSERVE_API_KEY="not-this-one")
    proc = subprocess.Popen([sys.executable, "-m", "jetserve", "serve", "--model", "random:tiny",
                             "--host", "127.0.0.1", "--grpc-port", "-1", "--http-port", "0",
                             "--api-key-file", str(path), "--no-warmup",
                             "--max-seq-len", "64", "--max-prefill-length", "32"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port = wait_listening(proc, 1, timeout_s=300)["HTTP"]
        with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url, timeout=60).status_code == 401
        assert httpx.get(url, headers={"x-api-key": "not-this-one"}, timeout=60).status_code == 401
        assert httpx.get(url, headers={"x-api-key": key}, timeout=60).status_code == 200
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"},
                         timeout=60).status_code == 200
    finally:
        proc.kill()
        proc.wait()


def test_tls_serves_both_and_the_lines_say_so(tmp_path):
    crt, key = self_signed(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "jetserve", "serve", "--model", "random:tiny",
                             "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0",
                             "--tls-cert", crt, "--tls-key", key, "--no-warmup",
                             "--max-seq-len", "64", "--max-prefill-length", "32"],
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        ports = wait_listening(proc, 2, timeout_s=300, lines=lines)
        text = "".join(lines)
        assert f"gRPC listening on 127.0.0.1:{ports['gRPC']} (TLS;" in text
        assert f"HTTP listening on https://127.0.0.1:{ports['HTTP']} " in text
        r = httpx.get(f"https://localhost:{ports['HTTP']}/health", timeout=60,
                      verify=ssl.create_default_context(cafile=crt))
        assert r.json() == {"status": "ok"}
    finally:
        proc.kill()
        proc.wait()


# A port taken between serve's check and the servers binding: the same one line, exit 2, and
# the gRPC server already started is stopped cleanly (no traceback after the error).
_TAKEN_AFTER_THE_CHECK = """
import socket, sys
from jetserve import cli
from jetserve.commands import serve
serve.check_free = lambda *a, **k: None
held = socket.socket(); held.bind(("127.0.0.1", 0)); held.listen()
print(held.getsockname()[1], flush=True)
sys.exit(cli.main(["serve", "--model", "random:tiny", "--host", "127.0.0.1", "--grpc-port", "0",
                   "--http-port", str(held.getsockname()[1]), "--no-warmup",
                   "--max-seq-len", "64", "--max-prefill-length", "32"]))
"""


def test_a_port_taken_after_the_check_is_one_line_too():
    r = subprocess.run([sys.executable, "-c", _TAKEN_AFTER_THE_CHECK], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    port = r.stdout.split()[0]
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"jetserve serve: error: HTTP port {port} on 127.0.0.1 is already in use\n"

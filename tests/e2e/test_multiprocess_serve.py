"""`jetserve serve` over 2 processes x 4 fake CPU devices (jax.distributed, gloo on
127.0.0.1), one model sharded over all 8: concurrent gRPC and OpenAI-client streams give
what single-process `jetserve generate` gives on 8 devices; SIGTERM to process 0 ends both.
The processes are told their group the way LeaderWorkerSet tells its pods: no
--coordinator / --num-processes / --process-id, but LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
LWS_WORKER_INDEX in their environment (jetserve.distributed.from_lws_environment); only
the leader (index 0) serves.

random:tiny has 2 kv heads, so `tp` cannot take 8 devices; the layout here is tensor
parallel with `model` as the outer mesh axis, so each process holds one half of every
split weight and every layer's all-reduce crosses processes (`data` splits the slots).
"""

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from jetserve.cli import main as jetserve_main
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from tests.xla import xla_flags

MODEL = "random:tiny"
TP_ACROSS_PROCESSES = """\
mesh: {model: 2, data: -1}
rules: {heads: model, kv_heads: model, mlp: model, vocab: model, cache_heads: model,
        batch: data, cache_batch: data}
"""
ENGINE = ["--max-seq-len", "64", "--max-prefill-length", "32", "--max-concurrent-decodes", "4"]
MAX_TOKENS = 10
# 6 requests for 4 slots: some wait for a slot, and they join the batch at different steps.
GRPC_PROMPTS = ["two hosts", "lock step", "x"]
HTTP_PROMPTS = ["one plan per turn", "gloo", "broadcast from process zero"]
SEEDED = ("sampled", 7)  # prompt, seed: temperature 1 with a seed
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def preset(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("preset") / "tp_across_processes.yaml"
    path.write_text(TP_ACROSS_PROCESSES)
    return str(path)


def _generate(preset, prompts, *extra):
    """Single-process `jetserve generate --json` on this process's 8 devices."""
    argv = ["generate", "--model", MODEL, *ENGINE, "--sharding", preset, "--devices", "8",
            "--json",
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", *extra]
    for p in prompts:
        argv += ["--prompt", p]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert jetserve_main(argv) == 0
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, preset):
    logs = tmp_path_factory.mktemp("multiprocess-serve")
    port = _free_port()
    procs, errs = [], []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=xla_flags(4),
                   LWS_LEADER_ADDRESS=f"127.0.0.1:{port}", LWS_GROUP_SIZE="2",
                   LWS_WORKER_INDEX=str(i))
        cmd = [sys.executable, "-m", "jetserve", "serve", "--model", MODEL, *ENGINE,
               "--sharding", preset,
               "--host", "127.0.0.1", "--grpc-port", "0", "--http-port", "0"]
        err = open(logs / f"process-{i}.stderr", "w+")  # noqa: SIM115 (closed below)
        errs.append(err)
        # Process 0's stdout says where it listens (read, then drained); everything else
        # goes to files, so no process can block on a full pipe and stall its peer.
        out = subprocess.PIPE if i == 0 else err
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=err,
                                      text=True))
    try:
        yield procs, errs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for e in errs:
            e.close()


def _ports(proc, errs) -> dict[str, int]:
    ports, lines = {}, []
    while not lines or "jetserve serve: ready" not in lines[-1]:  # listening, then warmed up
        line = proc.stdout.readline()
        if not line:
            errs[0].seek(0)
            pytest.fail("process 0 did not start serving:\n" + "".join(lines)
                        + errs[0].read()[-3000:])
        lines.append(line)
        m = re.search(r"(gRPC|HTTP) listening on (?:http://)?127\.0\.0\.1:(\d+)", line)
        if m:
            ports[m.group(1)] = int(m.group(2))
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
    return ports


def _grpc(port: int, prompt: str) -> tuple[list[int], str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = pb.DecodeRequest(max_tokens=MAX_TOKENS, ignore_eos=True,
                               text_content=pb.DecodeRequest.TextContent(text=prompt))
        msgs = list(pb_grpc.OrchestratorStub(ch).Decode(req, timeout=300))
    samples = [m.stream_content.samples[0] for m in msgs]
    return [t for s in samples for t in s.token_ids], "".join(s.text for s in samples)


async def _http(port: int) -> list:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                max_retries=0, timeout=300)

    async def one(prompt: str, **kw):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            extra_body={"ignore_eos": True}, **kw)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    try:
        return await asyncio.gather(*(one(p, temperature=0) for p in HTTP_PROMPTS),
                                    one(SEEDED[0], temperature=1.0, seed=SEEDED[1]))
    finally:
        await client.close()


@pytest.mark.slow
def test_two_serving_processes_match_single_process_generate(two_processes, preset):
    procs, errs = two_processes
    # References on this process's 8 devices while the two servers start.
    want = _generate(preset, GRPC_PROMPTS + HTTP_PROMPTS)
    (want_seeded,) = _generate(preset, [SEEDED[0]], "--temperature", "1.0",
                               "--seed", str(SEEDED[1]))
    ports = _ports(procs[0], errs)
    with ThreadPoolExecutor(len(GRPC_PROMPTS)) as pool:
        grpc_calls = [pool.submit(_grpc, ports["gRPC"], p) for p in GRPC_PROMPTS]
        http_got = asyncio.run(_http(ports["HTTP"]))
        grpc_got = [f.result(timeout=300) for f in grpc_calls]
    for (ids, text), w in zip(grpc_got, want[:len(GRPC_PROMPTS)], strict=True):
        assert ids == w["token_ids"] and text == w["text"]
    for (text, finish), w in zip(http_got, want[len(GRPC_PROMPTS):] + [want_seeded],
                                 strict=True):
        assert (text, finish) == (w["text"], "length")

    procs[0].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    for e in errs:
        e.seek(0)
    logs = [e.read() for e in errs]
    assert codes == [0, 0], [log[-3000:] for log in logs]
    assert "follows process 0" in logs[1] and "stopped" in logs[1]
    assert "listening" not in logs[1]  # only the leader serves
    assert not any("Traceback" in log for log in logs), logs

"""The split deployment on 127.0.0.1: two `jetserve serve --role prefill` workers (tp over
4 fake devices with a prefix cache; replicated on 2) and one `--role decode` process
(tp_kv_batch over 4), KV caches pulled with jax.experimental.transfer. Concurrent streams over gRPC and the
openai SDK give what `jetserve generate` gives; constrained samples match their structure;
echo and scoring carry the prompt's log-probs;
SIGKILL of a prefill worker mid-run loses
no stream and repeats no token; afterwards the surviving worker holds no prefix and every
decode slot is free. Bad worker addresses are start-up errors naming them.
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
import httpx
import openai
import pytest

from jetserve.cli import main as jetserve_main
from protos import jetstream_pb2 as pb
from protos import jetstream_pb2_grpc as pb_grpc
from protos import prefill_worker_pb2 as wpb
from protos import prefill_worker_pb2_grpc as wpb_grpc
from tests.e2e.serve_process import wait_listening
from tests.xla import xla_flags

MODEL = "random:tiny"
ENGINE = ["--model", MODEL, "--max-seq-len", "64", "--max-prefill-length", "32",
          "--max-concurrent-decodes", "8", "--host", "127.0.0.1"]
MAX_TOKENS = 8
# 16 over gRPC, 16 over HTTP; two prompts are longer than a prefill (chunked remotely).
PROMPTS = [[1, *range(2 + k, 6 + 2 * k)] for k in range(14)] + [[1, *range(3, 40)],
                                                                 [1, *range(50, 95)]]
# Worker a keeps a prefix cache (its hits are checked in tests/jetserve/disagg): every
# prefill there looks it up and caches its blocks, and the tokens must not change.
CACHE = ["--prefix-cache-hbm-mb", "8"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], devices: int, log) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=xla_flags(devices))
    return subprocess.Popen([sys.executable, "-m", "jetserve", "serve", *ENGINE, *args],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)


def _drain(proc: subprocess.Popen) -> None:
    threading.Thread(target=proc.stdout.read, daemon=True).start()


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    logs = tmp_path_factory.mktemp("split-serve")
    procs, files = {}, []

    def start(name, args, devices):
        f = open(logs / f"{name}.stderr", "w+")  # noqa: SIM115 (closed below)
        files.append(f)
        procs[name] = _start(args, devices, f)
        return procs[name]

    try:
        ports = {}
        for name, extra, devices in (("a", ["--sharding", "tp", *CACHE], 4),
                                     ("b", ["--sharding", "replicated"], 2)):
            p = start(name, ["--role", "prefill", "--grpc-port", str(_free_port()), *extra],
                      devices)
            ports[name] = wait_listening(p, 1)["gRPC"]
            _drain(p)
        workers = ",".join(f"127.0.0.1:{ports[n]}" for n in ("a", "b"))
        d = start("decode", ["--role", "decode", "--prefill-workers", workers,
                             "--sharding", "tp_kv_batch", "--grpc-port", "0",
                             "--http-port", "0"], 4)
        ports.update(wait_listening(d, 2))
        _drain(d)
        yield procs, ports, start
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in files:
            f.close()


def generate(prompts: list[list[int]]) -> list[dict]:
    """`jetserve generate --json` of `prompts`, greedy, in this process."""
    argv = ["generate", *ENGINE[:8], "--json", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert jetserve_main(argv) == 0
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def want():
    return generate(PROMPTS)


def _grpc(port: int, prompt: list[int], first: threading.Event) -> list[int]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = pb.DecodeRequest(max_tokens=MAX_TOKENS, ignore_eos=True, has_bos=True,
                               token_content=pb.DecodeRequest.TokenContent(token_ids=prompt))
        ids = []
        for m in pb_grpc.OrchestratorStub(ch).Decode(req, timeout=300):
            ids += m.stream_content.samples[0].token_ids
            first.set()
    return ids


async def _http(port: int, prompts: list[list[int]]) -> list[list[int]]:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                max_retries=0, timeout=300)

    async def one(prompt):  # token-id prompts are used verbatim, as --prompt-ids
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    try:
        return await asyncio.gather(*(one(p) for p in prompts))
    finally:
        await client.close()


def _run_all(ports: dict, on_first=None) -> tuple[list, list]:
    """gRPC streams for the first half of PROMPTS, HTTP for the rest, all at once;
    `on_first()` runs once the first gRPC token arrived."""
    half = len(PROMPTS) // 2
    first = threading.Event()
    with ThreadPoolExecutor(half + 1) as pool:
        calls = [pool.submit(_grpc, ports["gRPC"], p, first) for p in PROMPTS[:half]]
        if on_first is not None:
            pool.submit(lambda: (first.wait(300), on_first()))
        http = asyncio.run(_http(ports["HTTP"], PROMPTS[half:]))
        return [c.result(timeout=300) for c in calls], http


def _check(got_grpc, got_http, want) -> None:
    """Every stream as generate's: each token once, in order."""
    half = len(PROMPTS) // 2
    assert got_grpc == [w["token_ids"] for w in want[:half]]
    assert got_http == [(w["text"], "length") for w in want[half:]]


def _load(port: int) -> wpb.LoadResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return wpb_grpc.PrefillWorkerStub(ch).Load(wpb.LoadRequest(), timeout=30)


def _metric(port: int, name: str, label: str = "") -> float:
    """The sum of `name` over its series (those whose labels contain `label`)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(m.group(2)) for m in re.finditer(rf"^{name}({{[^}}]*}})? (\S+)$",
                                                      text, re.M) if label in (m.group(1) or ""))


def _settles(fn, timeout_s: float = 60) -> bool:
    """fn() true within timeout_s (a state to reach, not a duration to assert)."""
    end = time.monotonic() + timeout_s
    while not fn():
        if time.monotonic() > end:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.slow
def test_split_deployment_matches_generate(split, want):
    procs, ports, _ = split
    got_grpc, got_http = _run_all(ports)
    _check(got_grpc, got_http, want)
    assert _settles(lambda: _load(ports["a"]).registered + _load(ports["b"]).registered == 0)
    assert _metric(ports["HTTP"], "jetserve_kv_transfers") >= len(PROMPTS)
    assert _metric(ports["HTTP"], "jetserve_kv_transfer_bytes") > 0
    assert _metric(ports["HTTP"], "jetserve_prefill_worker_up") == 2


REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]


@pytest.mark.slow
def test_structured_output_on_the_decode_side(split):
    """The worker samples the first token within the grammar's mask, the decode side the
    rest: at temperature 1 (where an unmasked token would break the structure), every
    sample matches."""
    procs, ports, _ = split
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt=[1, 7, 9], max_tokens=12, n=6,
                                    temperature=1.0, seed=5,
                                    extra_body={"guided_regex": REGEX})
    assert [re.fullmatch(REGEX, c.text) is not None for c in out.choices] == [True] * 6
    assert {c.finish_reason for c in out.choices} == {"stop"}
    with grpc.insecure_channel(f"127.0.0.1:{ports['gRPC']}") as ch:
        req = pb.DecodeRequest(max_tokens=12, temperature=1.0, seed=3, num_samples=4,
                               token_content=pb.DecodeRequest.TokenContent(token_ids=[1, 4]),
                               choice=pb.DecodeRequest.Choices(choices=CHOICES))
        texts = [""] * 4
        for m in pb_grpc.OrchestratorStub(ch).Decode(req, timeout=300):
            for i, sample in enumerate(m.stream_content.samples):
                texts[i] += sample.text
    assert all(t in CHOICES for t in texts), texts


def _scored_here(prompt: list[int], n: int):
    """prompt_logprobs of `prompt` on random:tiny in this process (one device)."""
    import jax
    import numpy as np

    from engines import EngineConfig
    from jetserve.model_loading import build_engine
    from jetserve.orchestrator.prefill_worker import prompt_logprobs

    engine = build_engine(MODEL, devices=jax.devices()[:1], engine_config=EngineConfig(
        max_seq_len=64, max_prefill_length=32, max_concurrent_decodes=8))
    return prompt_logprobs(engine, engine.load_params(), np.asarray(prompt, np.int32), n)


@pytest.mark.slow
def test_echo_and_scoring_on_the_decode_side(split, want):
    """A worker scores the prompt on its prefill: echo with logprobs, and scoring alone
    (max_tokens 0), give the log-probs of one process; the generated part is generate's."""
    procs, ports, _ = split
    prompt = PROMPTS[3]
    values, alts = _scored_here(prompt, 2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    for max_tokens in (0, MAX_TOKENS):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                        echo=True, logprobs=2, temperature=0,
                                        extra_body={"ignore_eos": True})
        lp = out.choices[0].logprobs
        got = lp.token_logprobs[:len(prompt)]
        assert got[0] is None and got[1:] == pytest.approx(values[1:], abs=1e-4)
        assert len(lp.token_logprobs) == len(prompt) + max_tokens
        # Each prompt token's alternatives (and the token itself): the best is the same.
        assert [max(t.values()) for t in lp.top_logprobs[1:len(prompt)]] == pytest.approx(
            [a[0][1] for a in alts[1:]], abs=1e-4)
    assert out.choices[0].text.endswith(want[3]["text"])


@pytest.mark.slow
def test_sigkill_of_a_prefill_worker_loses_no_stream(split, want):
    procs, ports, _ = split
    got_grpc, got_http = _run_all(ports, on_first=lambda: procs["a"].send_signal(signal.SIGKILL))
    assert procs["a"].wait(30) == -signal.SIGKILL
    _check(got_grpc, got_http, want)
    assert _settles(lambda: _load(ports["b"]).registered == 0)
    assert _settles(lambda: _metric(ports["HTTP"], "jetserve_slots_in_use") == 0)
    assert _metric(ports["HTTP"], "jetserve_requests_in_flight") == 0
    # Requests did meet the dead worker, and went elsewhere.
    assert (_metric(ports["HTTP"], "jetserve_remote_prefill_retries")
            + _metric(ports["HTTP"], "jetserve_kv_transfer_retries")) >= 1
    # The decode process serves on with the one worker left.
    again, _ = _run_all(ports)
    assert again == [w["token_ids"] for w in want[:len(PROMPTS) // 2]]


@pytest.mark.slow
def test_a_worker_restarted_on_its_address_takes_requests_again(split, want):
    procs, ports, start = split
    assert procs["a"].poll() is not None  # killed above
    p = start("a", ["--role", "prefill", "--grpc-port", str(ports["a"]), "--sharding", "tp",
                    *CACHE], 4)
    assert wait_listening(p, 1)["gRPC"] == ports["a"]
    _drain(p)
    up = lambda: _metric(ports["HTTP"], "jetserve_prefill_worker_up",  # noqa: E731
                         f'address="127.0.0.1:{ports["a"]}"') == 1
    assert _settles(up)  # the decode process saw it answer Load again
    got_grpc, got_http = _run_all(ports)
    _check(got_grpc, got_http, want)
    assert _load(ports["a"]).prefills > 0  # and sent it prompts
    assert _settles(lambda: _load(ports["a"]).registered + _load(ports["b"]).registered == 0)


def _decode_error(workers: str, timeout: str = "5") -> str:
    """stderr of a decode process that must refuse `workers` at start-up."""
    argv = [sys.executable, "-m", "jetserve", "serve", *ENGINE, "--role", "decode",
            "--prefill-workers", workers, "--prefill-connect-timeout", timeout,
            "--grpc-port", "0", "--http-port", "0", "--no-warmup"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    return out.stderr


@pytest.mark.slow
def test_bad_worker_addresses_are_startup_errors(split):
    procs, ports, start = split
    closed = _free_port()
    assert f"127.0.0.1:{closed} is unreachable" in _decode_error(f"127.0.0.1:{closed}", "2")
    # The decode process's own gRPC port serves jetstream's Orchestrator, not a worker.
    err = _decode_error(f"127.0.0.1:{ports['gRPC']}")
    assert f"127.0.0.1:{ports['gRPC']} does not serve jetserve_disagg.PrefillWorker" in err
    # A worker of another model (4 layers, not 2) is refused before any prefix moves.
    other = start("other", ["--role", "prefill", "--grpc-port", "0", "--model", "random:small"],
                  1)
    port = wait_listening(other, 1)["gRPC"]
    _drain(other)
    err = _decode_error(f"127.0.0.1:{port}")
    assert f"--prefill-workers: 127.0.0.1:{port} makes prefixes with head_dim=32" in err
    other.send_signal(signal.SIGTERM)
    assert other.wait(120) == 0


@pytest.mark.slow
def test_sigterm_drains_both_roles(split, want):
    procs, ports, _ = split
    first = threading.Event()
    with ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(_grpc, ports["gRPC"], p, first) for p in PROMPTS[:4]]
        assert first.wait(300)
        procs["decode"].send_signal(signal.SIGTERM)  # streams in flight still finish
        got = [c.result(timeout=300) for c in calls]
    assert got == [w["token_ids"] for w in want[:4]]
    assert procs["decode"].wait(120) == 0
    procs["b"].send_signal(signal.SIGTERM)
    assert procs["b"].wait(120) == 0

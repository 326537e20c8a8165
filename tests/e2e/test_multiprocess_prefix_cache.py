"""`jetserve serve` over 2 processes x 4 fake CPU devices in lock step, with the prefix
cache on: every process keeps its own cache of its own shards (the KV heads split across
the processes, test_multiprocess_serve.py's layout), and both take the same hit
decisions. Prompts sharing a 3-block prefix hit it (the hit tokens show in process 0's
/metrics), a device tier of 3 blocks sends them to the host when another prompt comes and
a later hit brings them back; every answer equals single-process `jetserve generate`'s,
which has no cache. Warm-up off."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import httpx

from jetserve.cli import main as jetserve_main
from tests.e2e.split_processes import logged, sigterm_all_exit_cleanly
from tests.e2e.test_multiprocess_serve import ENGINE, MODEL, ROOT, _free_port, _ports, preset
from tests.xla import xla_flags

__all__ = ["preset"]  # the fixture, shared with test_multiprocess_serve.py

BLOCK = 16  # OrchestratorConfig.prefix_cache_block
BLOCK_MB = 16 * 512 / 2**20  # random:tiny: 2 layers x K and V x 2 heads x 16 dims x f32
SHARED = [(7 * j) % 200 + 3 for j in range(3 * BLOCK)]
OTHER = [(11 * j) % 200 + 5 for j in range(3 * BLOCK)]
# One after the other: a miss, a device hit, another prompt (the first's blocks go to the
# host), a host hit.
PROMPTS = [SHARED + [1, 2, 3, 4], SHARED + [5, 6], OTHER + [7, 8, 9], SHARED + [10]]
MAX_TOKENS = 8


def _reference(preset: str) -> list[list[int]]:
    argv = ["generate", "--model", MODEL, *ENGINE, "--sharding", preset, "--devices", "8",
            "--json", "--max-tokens", str(MAX_TOKENS), "--ignore-eos"]
    for p in PROMPTS:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert jetserve_main(argv) == 0
    return [json.loads(line)["token_ids"] for line in out.getvalue().splitlines()
            if line.startswith("{")]


def _complete(client: httpx.Client, prompt: list[int]) -> list[int]:
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} (\S+)$", text, re.M)
    assert m, f"{name}{{{want}}} not in /metrics"
    return float(m.group(1))


def test_two_processes_share_prefix_cache_hits_and_tokens(tmp_path, preset):
    port = _free_port()
    with logged(tmp_path, ["p0", "p1"]) as (procs, files):
        for i in range(2):
            cmd = [sys.executable, "-m", "jetserve", "serve", "--model", MODEL, *ENGINE,
                   "--sharding", preset, "--no-warmup", "--host", "127.0.0.1",
                   "--grpc-port", "0", "--http-port", "0",
                   "--prefix-cache-hbm-mb", str(3 * BLOCK_MB), "--prefix-cache-host-mb", "1",
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(i)]
            env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, text=True, stderr=files[i],
                                          stdout=subprocess.PIPE if i == 0 else files[i]))
        want = _reference(preset)  # while the two servers start
        ports = _ports(procs[0], files)
        with httpx.Client(base_url=f"http://127.0.0.1:{ports['HTTP']}", timeout=300) as c:
            got = [_complete(c, p) for p in PROMPTS]
            metrics = c.get("/metrics").text
        assert got == want
        # Two hits of 48 tokens each (3 blocks), the second from the host tier.
        assert _metric(metrics, "vllm:prefix_cache_hits_total", model_name=MODEL) == 96
        assert _metric(metrics, "jetserve_prefix_cache_blocks", engine="0", tier="hbm") == 3
        assert _metric(metrics, "jetserve_prefix_cache_blocks", engine="0", tier="host") == 3
        sigterm_all_exit_cleanly(procs, files, [0])

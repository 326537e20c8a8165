"""A prefill worker over two processes (`jetserve serve --role prefill --coordinator`,
2 x 2 fake CPU devices, jax.distributed with gloo on 127.0.0.1: one tp engine over all 4)
and a `--role decode` process (tp_kv_batch over 2): each prefix's blocks are pulled from
both processes' transfer servers. Concurrent gRPC and openai-SDK streams give what
`jetserve generate` gives, a prompt scored there has the log-probs of one process; with
the prefix cache on (every process its own), a prompt sent again hits what its first
prefill cached and answers the same;
afterwards no prefix is held on either process, and SIGTERM to
process 0 stops both.
"""

import openai
import pytest

from tests.e2e.serve_process import wait_listening
from tests.e2e.split_processes import logged, sigterm_all_exit_cleanly, streams_match
from tests.e2e.test_split_serve import (
    CACHE,
    MODEL,
    PROMPTS,
    _drain,
    _free_port,
    _load,
    _scored_here,
    _settles,
    _start,
    generate,
)

# Short prompts, and the two longer than a prefill (chunked on the two processes).
PROMPTS_HERE = [PROMPTS[i] for i in (0, 5, 11, 14, 15)]
HALF = 2  # over gRPC; the rest over HTTP


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("split-serve-processes")
    coordinator = f"127.0.0.1:{_free_port()}"
    with logged(logs, ["p0", "p1", "decode"]) as (procs, files):
        for i in range(2):
            procs.append(_start(["--role", "prefill", "--grpc-port", "0", "--sharding", "tp",
                                 "--coordinator", coordinator, "--num-processes", "2",
                                 "--process-id", str(i), *CACHE], 2, files[i]))
        worker = wait_listening(procs[0], 1)["gRPC"]
        _drain(procs[0])
        _drain(procs[1])
        procs.append(_start(["--role", "decode", "--prefill-workers", f"127.0.0.1:{worker}",
                             "--sharding", "tp_kv_batch", "--grpc-port", "0",
                             "--http-port", "0"], 2, files[2]))
        ports = wait_listening(procs[2], 2)
        _drain(procs[2])
        yield procs, files, worker, ports


@pytest.fixture(scope="module")
def want():
    return generate(PROMPTS_HERE)


@pytest.mark.slow
def test_prefill_worker_over_two_processes_matches_generate(deployment, want):
    procs, files, worker, ports = deployment
    prompts = PROMPTS_HERE
    streams_match(ports, prompts, HALF, want)
    # The longest prompt (46 tokens) again: its 2 whole blocks of 16 are a hit on both
    # processes alike (or their steps would part), and the answer is generate's.
    hits = _load(worker).prefix_cache_hits
    streams_match(ports, prompts[-1:], 1, want[-1:])
    assert _load(worker).prefix_cache_hits - hits == 32
    # Scoring runs on both processes too (one program over the 4 devices).
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    scored = client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=0,
                                       echo=True, logprobs=1)
    values, _ = _scored_here(prompts[1], 1)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(values[1:],
                                                                          abs=1e-4)
    assert _settles(lambda: _load(worker).registered == 0)

    # Process 1 follows process 0 out; every process exits 0, no traceback.
    logs = sigterm_all_exit_cleanly(procs, files, [2, 0])
    # Process 1 freed its blocks of every prefix as process 0's turns passed the acks on.
    assert "follows process 0's prefills" in logs[1]
    assert "stopped (0 prefixes still held)" in logs[1]


"""A decode role over two processes (`jetserve serve --role decode --coordinator`, 2 x 2
fake CPU devices, jax.distributed with gloo on 127.0.0.1: one tp_kv_batch generate engine
over all 4) fed by a `--role prefill` process (tp over 2): process 0 pulls each prefix and
spreads it over both processes before the insert. Concurrent gRPC and openai-SDK streams
give what `jetserve generate` gives; afterwards the worker holds no prefix and no slot is
in use, structured output is refused by name, and SIGTERM to process 0 stops both decode processes.
"""

import openai
import pytest

from tests.e2e.serve_process import wait_listening
from tests.e2e.split_processes import logged, sigterm_all_exit_cleanly, streams_match
from tests.e2e.test_split_serve import (
    MODEL,
    PROMPTS,
    REGEX,
    _drain,
    _free_port,
    _load,
    _metric,
    _settles,
    _start,
    generate,
)

# Short prompts, and the two longer than a prefill (chunked on the worker).
PROMPTS_HERE = [PROMPTS[i] for i in (0, 3, 5, 8, 11, 14, 15)]
HALF = 3  # over gRPC; the rest over HTTP


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    logs = tmp_path_factory.mktemp("split-decode-processes")
    coordinator = f"127.0.0.1:{_free_port()}"
    with logged(logs, ["prefill", "d0", "d1"]) as (procs, files):
        procs.append(_start(["--role", "prefill", "--grpc-port", "0", "--sharding", "tp"], 2,
                            files[0]))
        worker = wait_listening(procs[0], 1)["gRPC"]
        _drain(procs[0])
        for i in range(2):
            procs.append(_start(["--role", "decode", "--prefill-workers", f"127.0.0.1:{worker}",
                                 "--sharding", "tp_kv_batch", "--grpc-port", "0",
                                 "--http-port", "0", "--coordinator", coordinator,
                                 "--num-processes", "2", "--process-id", str(i)], 2, files[i + 1]))
        ports = wait_listening(procs[1], 2)
        _drain(procs[1])
        _drain(procs[2])
        yield procs, files, worker, ports


@pytest.mark.slow
def test_decode_role_over_two_processes_matches_generate(deployment):
    streams_match(deployment[3], PROMPTS_HERE, HALF, generate(PROMPTS_HERE))
    procs, files, worker, ports = deployment
    assert _settles(lambda: _load(worker).registered == 0)
    assert _settles(lambda: _metric(ports["HTTP"], "jetserve_slots_in_use") == 0)
    # Structured output is refused by name (its per-step masks are not broadcast).
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['HTTP']}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    with pytest.raises(openai.BadRequestError, match="guided_regex: structured output is not "
                       "available when several processes serve one model"):
        client.completions.create(model=MODEL, prompt=[1, 7, 9], max_tokens=4,
                                  extra_body={"guided_regex": REGEX})

    # Process 1 follows process 0 out; every process exits 0, no traceback.
    logs = sigterm_all_exit_cleanly(procs, files, [0, 1])
    assert "follows process 0's steps" in logs[2]
    assert "jetserve serve: stopped" in logs[2]
    # Every prefix reached both processes the first time (none prefilled again).
    assert "did not receive its part" not in logs[1], logs[1][-3000:]

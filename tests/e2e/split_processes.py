"""What the split-deployment tests over several processes share: starting the processes
with their stderr in files (killed and closed at the end), streaming prompts over gRPC
and HTTP at once (as generate gives them), and stopping with SIGTERM, checking every process exits cleanly."""

import asyncio
import contextlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tests.e2e.test_split_serve import _grpc, _http, _metric


@contextlib.contextmanager
def logged(logs, names: list[str]):
    """(processes, stderr files by `names`): the caller appends the processes it starts;
    any still running at the end are killed."""
    files = [open(logs / f"{n}.stderr", "w+") for n in names]  # noqa: SIM115
    procs = []
    try:
        yield procs, files
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in files:
            f.close()


def log_text(f) -> str:
    f.seek(0)
    return f.read()


def streams_match(ports: dict, prompts: list[list[int]], half: int, want: list[dict]) -> None:
    """The first `half` prompts over gRPC and the rest over HTTP, streamed at once, give
    `want` (generate's), and each prefix was pulled."""
    first = threading.Event()
    with ThreadPoolExecutor(half) as pool:
        calls = [pool.submit(_grpc, ports["gRPC"], p, first) for p in prompts[:half]]
        http = asyncio.run(_http(ports["HTTP"], prompts[half:]))
        got = [c.result(timeout=300) for c in calls]
    assert got == [w["token_ids"] for w in want[:half]]
    assert http == [(w["text"], "length") for w in want[half:]]
    assert _metric(ports["HTTP"], "jetserve_kv_transfers") >= len(prompts)


def sigterm_all_exit_cleanly(procs, files, signalled) -> list[str]:
    """SIGTERM to `signalled` (indices, in order); every process exits 0 with no traceback
    in its log; returns the logs."""
    for i in signalled:
        procs[i].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in procs]
    logs = [log_text(f) for f in files]
    assert codes == [0] * len(procs), [log[-3000:] for log in logs]
    assert not any("Traceback" in log for log in logs), [log[-3000:] for log in logs]
    return logs

"""Two processes x 4 fake CPU devices (jax.distributed, gloo on 127.0.0.1) = one process x 8.

Each process runs `jetserve generate` on the same arguments; the engine's mesh spans all 8
devices, so every step is one SPMD program over both processes (the lock-step
orchestrator: process 0 plans, process 1 follows), the prefix cache on. Process 0 prints,
process 1 prints nothing, and the tokens equal a single process's on 8 devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from jetserve import cli
from tests.xla import xla_flags

ARGS = ["generate", "--model", "random:tiny", "--sharding", "tp_kv_batch",
        "--prompt-ids", "5,6,7,8", "--prompt-ids", "9,10", "--prompt-ids", "200,1,3,3,7",
        "--max-tokens", "8", "--ignore-eos", "--json", "--max-seq-len", "64",
        "--max-concurrent-decodes", "4", "--enable-prefix-caching"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(port: int, process_id: int, log_dir) -> tuple[subprocess.Popen, object, object]:
    env = dict(os.environ, XLA_FLAGS=xla_flags(4),
               JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "-m", "jetserve", *ARGS, "--coordinator", f"127.0.0.1:{port}",
           "--num-processes", "2", "--process-id", str(process_id)]
    # Files, not pipes: nobody reads a pipe while the reference runs, and a process blocked
    # on a full pipe (gloo logs a line per communicator) would stall its peer's collectives.
    out = open(log_dir / f"p{process_id}.out", "w+")  # noqa: SIM115
    err = open(log_dir / f"p{process_id}.err", "w+")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=err, text=True)
    return proc, out, err


def _read(f) -> str:
    f.seek(0)
    return f.read()


@pytest.mark.slow
def test_two_processes_match_one(capsys, tmp_path):
    port = _free_port()
    spawned = [_spawn(port, i, tmp_path) for i in range(2)]
    procs = [p for p, _, _ in spawned]
    try:
        # The single-process reference runs meanwhile, on this process's 8 devices.
        assert cli.main([*ARGS, "--devices", "8"]) == 0
        want = capsys.readouterr().out.splitlines()
        for p in procs:
            p.wait(timeout=400)
        outs = [(_read(out), _read(err)) for _, out, err in spawned]
    finally:
        for p, out, err in spawned:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close()
            err.close()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert len(want) == 3
    assert outs[0][0].splitlines() == want
    assert outs[1][0].strip() == ""

"""`jetserve serve` as a child process: wait for the lines that say where it listens, and
for the one that says it takes requests (after its warm-up)."""

import re
import subprocess
import time

from tests.xla import xla_flags

_LISTENING = re.compile(r"(gRPC|HTTP) listening on (?:https?://)?127\.0\.0\.1:(\d+)")
READY = "jetserve serve: ready"


def wait_listening(proc: subprocess.Popen, count: int, timeout_s: float = 600,
                   lines: list[str] | None = None, ready: bool = True) -> dict[str, int]:
    """{"gRPC" / "HTTP": port} once `count` servers said they listen (and, with `ready`,
    the process said it takes requests); AssertionError with what the process printed if
    it stopped or `timeout_s` passed first.

    The lines read so far are appended to `lines` when given.
    """
    lines = [] if lines is None else lines
    ports = {}
    deadline = time.monotonic() + timeout_s
    is_ready = not ready
    while (len(ports) < count or not is_ready) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = _LISTENING.search(line)
        if m:
            ports[m.group(1)] = int(m.group(2))
        is_ready = is_ready or READY in line
    if len(ports) < count or not is_ready:
        proc.kill()
        raise AssertionError("jetserve serve did not start:\n" + "".join(lines))
    return ports


def spawn(argv: list[str]) -> subprocess.Popen:
    """`python -m jetserve serve ARGV` on the CPU with 8 fake devices, its stdout and
    stderr in one text pipe (read it with `wait_listening`)."""
    import os
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=xla_flags(8))
    return subprocess.Popen([sys.executable, "-m", "jetserve", "serve", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

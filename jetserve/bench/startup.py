"""Start-up: process start to first token, with a cold and then a warm compile cache.

Runs `jetserve generate --max-tokens 1 --json` twice as a fresh process on one new,
empty cache directory: the first run compiles every program and writes it to the cache
(cold), the second reads them back (warm). Each run is timed from spawning the process to
its JSON line on stdout (the first and only token), so Python start, imports, the model
load, tracing and compiling all count. The compile share is the seconds the process spent
in XLA compiles (or cache reads) over that time, from the line `jetserve generate` prints
on stderr (jetserve/compile_cache.py counts them). Each start also reports its CPU seconds
(user + system, the whole process): on a shared, loaded host the wall time stretches with
the other load, the CPU time much less, so `cpu_warm_over_cold` is the steadier ratio.
"""

from __future__ import annotations

import dataclasses
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

# "jetserve generate: compiled 12 programs in 2.91 s (0 from cache); tracing and
# lowering 1.20 s"
_LINE = re.compile(r"compiled (\d+) programs? in ([\d.]+) s \((\d+) from cache\); "
                   r"tracing and lowering ([\d.]+) s")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StartupConfig:
    model: str | None = None  # None: the bundled model
    prompt_len: int = 16
    max_seq_len: int = 256
    timeout_s: float = 900.0

    def __post_init__(self):
        if not 1 <= self.prompt_len < self.max_seq_len:
            raise ValueError(f"prompt_len must be in [1, max_seq_len={self.max_seq_len}), "
                             f"got {self.prompt_len}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def command(cfg: StartupConfig, cache_dir: str) -> list[str]:
    ids = ",".join(str(1 + i % 50) for i in range(cfg.prompt_len))  # in any vocabulary
    cmd = [sys.executable, "-m", "jetserve", "generate", "--prompt-ids", ids,
           "--max-tokens", "1", "--ignore-eos", "--max-seq-len", str(cfg.max_seq_len),
           "--compile-cache", cache_dir, "--json"]
    return cmd + (["--model", cfg.model] if cfg.model else [])


def one_start(cfg: StartupConfig, cache_dir: str, label: str, *, cwd: str | None = None,
              env: dict | None = None) -> dict:
    """Spawns one `jetserve generate` (in `cwd`, with `env`: by default this process's);
    seconds to its first token and its compile line."""
    err: list[str] = []
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # the start is the one child reaped
    t0 = time.monotonic()
    proc = subprocess.Popen(command(cfg, cache_dir), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    first = None
    timer = threading.Timer(cfg.timeout_s, proc.kill)  # bounds a hung start
    timer.start()
    try:
        for line in proc.stdout:
            if first is None and line.startswith("{"):
                first = time.monotonic() - t0
        rc = proc.wait()
    finally:
        timer.cancel()
    reader.join(30)
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (now.ru_utime - used.ru_utime) + (now.ru_stime - used.ru_stime)
    m = next((m for m in map(_LINE.search, err) if m), None)
    if rc != 0 or first is None or m is None:
        tail = "".join(err[-20:])
        raise RuntimeError(f"{label} start: `jetserve generate` exited {rc} without its "
                           f"token or its compile line:\n{tail}")
    compile_s = float(m.group(2))
    return {"cache": label, "first_token_s": round(first, 3),
            "compile_s": compile_s, "compile_share": round(compile_s / first, 3),
            "trace_s": float(m.group(4)), "cpu_s": round(cpu_s, 3), "programs": int(m.group(1)),
            "from_cache": int(m.group(3))}


def run(cfg: StartupConfig, log: Callable[..., None] = print) -> dict:
    with tempfile.TemporaryDirectory(prefix="jetserve-startup-") as cache_dir:
        log(f"cold start (empty cache {cache_dir})")
        cold = one_start(cfg, cache_dir, "cold")
        log(f"warm start (the same cache, {len(os.listdir(cache_dir))} entries)")
        warm = one_start(cfg, cache_dir, "warm")
    return {"model": cfg.model or "bundled", "prompt_len": cfg.prompt_len,
            "max_seq_len": cfg.max_seq_len, "cold": cold, "warm": warm,
            "warm_over_cold": round(warm["first_token_s"] / cold["first_token_s"], 3),
            "cpu_warm_over_cold": round(warm["cpu_s"] / cold["cpu_s"], 3),
            "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2)}

"""Prefill of long prompts: tokens/s, XLA's temp bytes and peak RSS, against the compute floor.

Each length runs in a process of its own (`python -m jetserve.bench.prefill CONFIG`,
which prints one JSON line), so each peak RSS is that length's alone. The process builds
the engine on one device, prefills a random prompt of that length in chunks of `chunk`
tokens (the first continuing `engine.empty_prefix(length)`, each next one the previous
chunk's prefix, donated, as the orchestrator's chunk loops do; a prompt no longer than a
chunk goes whole), and reports:

  - tokens/s over the timed pass. Each new program shape is compiled ahead of its first
    call (`engine.lower_prefill(...).compile()`, through a persistent compile cache in a
    temp directory), and the compile is not timed; the call then reads the cache. When a
    pass takes under `rerun_below_s`, a second, warm pass is timed instead.
  - temp_bytes: the largest `memory_analysis().temp_size_in_bytes` of those programs.
  - peak_rss_bytes: the process's peak resident memory while it prefills (Linux VmHWM,
    restarted around each phase), next to the bytes of the weights and of the prompt's
    KV. Loading (random weights are initialised on the side) and XLA's compiles peak
    on their own, reported as load_peak_rss_bytes and compile_peak_rss_bytes; after each
    compile the C heap is trimmed (malloc_trim) so what the compiler freed does not
    count against the prefill.
  - floor_s: matmul FLOPs (every projection, per prompt token, plus the LM head once per
    chunk) plus attention FLOPs (q.k and p.v over the key positions each query sees,
    causal and windowed) over the f32 matmul FLOP/s measured in the same process
    (jetserve.bench.bandwidth.matmul_flops); fraction_of_floor = floor_s / seconds.

`attention` picks the prefill attention (engines/backend.py): "auto" (what the engine
picks for its devices) or a name of engines.backend.PREFILL_ATTENTION; "plain" is the
one-shot [T, S] score path every prefill took before the blockwise one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from engines.backend import PREFILL_ATTENTION
from engines.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillBenchConfig:
    model: str = "random:llama-156m"
    lengths: tuple[int, ...] = (1024, 4096, 16384, 32768)
    chunk: int = 2048
    attention: str = "auto"
    matmul_size: int = 1024
    rerun_below_s: float = 60.0
    timeout_s: float = 1800.0

    def __post_init__(self):
        if not self.lengths or any(not isinstance(n, int) or n < 2 for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 2, got {self.lengths!r}")
        if not isinstance(self.chunk, int) or self.chunk < 16:
            raise ValueError(f"chunk must be an integer >= 16, got {self.chunk!r}")
        if self.attention not in ("auto", *PREFILL_ATTENTION):
            raise ValueError(f"attention must be 'auto' or one of {PREFILL_ATTENTION}, "
                             f"got {self.attention!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


def parse_lengths(text: str) -> tuple[int, ...]:
    """--lengths: comma-separated prompt lengths, each >= 2."""
    try:
        out = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not out or any(n < 2 for n in out):
        raise ValueError(f"--lengths must list integers >= 2, got {text!r}")
    return out


def prefill_flops(c: ModelConfig, length: int, chunk: int) -> float:
    """Matmul plus attention FLOPs of prefilling `length` tokens in chunks of `chunk`."""
    D, F, N, K, H = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim
    experts = max(c.num_experts_per_tok, 1) if c.num_experts else 1
    per_token = c.num_layers * (2 * D * N * H + 2 * D * K * H + 3 * D * F * experts)
    chunks = -(-length // chunk)
    matmul = 2.0 * (length * per_token + chunks * c.vocab_size * D)
    W = min(c.sliding_window or length, length)
    pairs = W * (W + 1) / 2 + (length - W) * W  # query p sees min(p + 1, W) keys
    attention = 4.0 * c.num_layers * N * H * pairs
    return matmul + attention


def _engine(cfg: PrefillBenchConfig, length: int):
    import jax

    from engines import EngineConfig, create_engine
    from engines.backend import Backend, backend_for
    from jetserve.model_loading import resolve_model

    src = resolve_model(cfg.model)
    devices = jax.devices()[:1]
    engine_config = EngineConfig(max_concurrent_decodes=1, max_seq_len=length, top_logprobs=0,
                                 max_prefill_length=min(cfg.chunk, length))
    dtype = "float32" if devices[0].platform == "cpu" else "bfloat16"
    backend = (backend_for(devices, dtype) if cfg.attention == "auto"
               else Backend(prefill_attention=cfg.attention))
    return create_engine(src.config, weights=src.path, devices=devices, config=engine_config,
                         backend=backend)


def _one_pass(engine, params, tokens, chunk: int, temps: dict,
              peaks: dict) -> tuple[float, float]:
    """Prefills `tokens` chunk by chunk; (seconds in prefill calls, seconds compiling).
    Each new program shape is compiled first and its temp bytes kept in `temps`; the
    peak RSS of runs and of compiles go to peaks["run"] and peaks["compile"]."""
    import jax

    from engines.prefix_blocks import stack_size

    run_s, compile_s = 0.0, 0.0
    t0 = time.perf_counter()
    # Several chunks: the prompt's KV allocated once at its final size (as the
    # orchestrator's chunk loops do), timed with the prefill.
    prefix = engine.empty_prefix(len(tokens)) if len(tokens) > chunk else None
    jax.block_until_ready(prefix)
    run_s += time.perf_counter() - t0
    for start in range(0, len(tokens), chunk):
        piece = tokens[start:start + chunk]
        bucket = engine.bucket_for(len(piece))
        cap = None if prefix is None else prefix.k_pos.shape[1]
        if cap is not None and cap < start + bucket:  # the engine grows the prefix first
            cap = stack_size(start + bucket)
        key = (bucket, cap)  # the program's shape
        if key not in temps:
            peaks["run"] = max(peaks["run"], _peak_rss(reset=True))
            t0 = time.perf_counter()
            compiled = engine.lower_prefill(params, piece, len(piece), existing_prefix=prefix,
                                            donate=True).compile()
            temps[key] = int(compiled.memory_analysis().temp_size_in_bytes)
            compile_s += time.perf_counter() - t0
            del compiled
            peaks["compile"] = max(peaks["compile"], _peak_rss())
            _trim_heap()
            _peak_rss(reset=True)
        t0 = time.perf_counter()
        prefix, _ = engine.prefill(params, piece, len(piece), existing_prefix=prefix,
                                   donate=True)
        jax.block_until_ready(prefix)
        run_s += time.perf_counter() - t0
    return run_s, compile_s


def _trim_heap() -> None:
    """Hands the C heap's free pages back to the OS (glibc), where it can."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_rss(reset: bool = False) -> int:
    """The process's peak resident bytes so far (Linux VmHWM); `reset` then restarts the
    peak from the current RSS, so what follows is measured alone."""
    with open("/proc/self/status") as f:
        peak = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    return peak


def measure_length(cfg: PrefillBenchConfig, length: int) -> dict:
    """One length, in this process (the worker's job)."""
    import jax
    import numpy as np

    from jetserve import compile_cache
    from jetserve.bench.bandwidth import matmul_flops

    with tempfile.TemporaryDirectory(prefix="jetserve-prefill-bench-") as cache:
        compile_cache.enable(cache)
        flops_per_s = matmul_flops("float32", size=cfg.matmul_size)
        engine = _engine(cfg, length)
        params = engine.load_params()
        jax.block_until_ready(params)
        load_peak = _peak_rss()  # loading random weights peaks on its own
        _trim_heap()
        _peak_rss(reset=True)
        tokens = np.random.default_rng(0).integers(1, engine.vocab_size, length).astype(np.int32)
        temps: dict = {}
        peaks = {"run": 0, "compile": 0}
        run_s, compile_s = _one_pass(engine, params, tokens, cfg.chunk, temps, peaks)
        passes = 1
        if run_s < cfg.rerun_below_s:
            run_s, _ = _one_pass(engine, params, tokens, cfg.chunk, temps, peaks)
            passes = 2
    c = engine.model_config
    floor_s = prefill_flops(c, length, cfg.chunk) / flops_per_s
    weights = c.param_count() * 4
    kv = c.kv_bytes_per_token(4) * length
    rss = max(peaks["run"], _peak_rss())
    return {"length": length, "chunk": min(cfg.chunk, length),
            "attention": engine.backend.prefill_attention, "passes": passes,
            "seconds": round(run_s, 6), "tokens_per_s": round(length / run_s, 1),
            "compile_s": round(compile_s, 2), "programs": len(temps),
            "temp_bytes": max(temps.values()), "peak_rss_bytes": rss,
            "load_peak_rss_bytes": load_peak, "compile_peak_rss_bytes": peaks["compile"],
            "weights_bytes": weights, "kv_bytes": kv,
            "rss_over_weights_kv_gb": round((rss - weights - kv) / 1e9, 3),
            "matmul_gflops": round(flops_per_s / 1e9, 1), "floor_s": round(floor_s, 6),
            "fraction_of_floor": round(floor_s / run_s, 4), "device": jax.devices()[0].platform}


def run(cfg: PrefillBenchConfig, log: Callable[..., None] = print) -> dict:
    """Every length, each in a fresh process."""
    rows = []
    for length in cfg.lengths:
        log(f"prefill {length} tokens ({cfg.attention} attention, chunks of {cfg.chunk}) ...")
        arg = json.dumps(dict(dataclasses.asdict(cfg), lengths=[length]))
        proc = subprocess.run([sys.executable, "-m", "jetserve.bench.prefill", arg],
                              capture_output=True, text=True, timeout=cfg.timeout_s,
                              env=dict(os.environ))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"prefill of {length} tokens failed (exit {proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}")
        rows.append(json.loads(lines[-1]))
    return {"config": dataclasses.asdict(cfg), "rows": rows}


def _main(arg: str) -> None:
    d = json.loads(arg)
    cfg = PrefillBenchConfig(**dict(d, lengths=tuple(d["lengths"])))
    print(json.dumps(measure_length(cfg, cfg.lengths[0])), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])

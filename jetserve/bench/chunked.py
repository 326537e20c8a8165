"""Inter-token latency of running requests while long prompts arrive, chunked prefill or not.

One engine, interleaved. `running` requests stream long outputs; once they all stream,
`arrivals` long prompts are submitted one after another (each after the previous one's
first token). The inter-token gaps of the running requests from the first arrival to the
last arrival's first token are the figure: p50 / p99 / max, with whole-prompt prefill
(the generate thread waits while a prompt is prefilled) and with `--prefill-chunk`
(it steps between chunks). Each mode first runs the same workload once untimed, so
every program it needs is compiled before the measured run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from engines import EngineConfig
from jetserve.model_loading import build_engine
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChunkedConfig:
    model: str = "random:small"
    prompt_len: int = 1000
    chunk: int = 128
    running: int = 4
    arrivals: int = 4
    max_seq_len: int = 2048

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}")
        if self.chunk >= self.prompt_len:
            raise ValueError(f"chunk ({self.chunk}) must be shorter than prompt_len "
                             f"({self.prompt_len}) for prompts to be chunked")
        if self.prompt_len >= self.max_seq_len:
            raise ValueError(f"prompt_len ({self.prompt_len}) must be below max_seq_len "
                             f"({self.max_seq_len})")


def _workload(orch: Orchestrator, cfg: ChunkedConfig, rng) -> list[float]:
    """Inter-token gaps (s) of the running requests while the long prompts arrive."""
    running = [orch.submit(Request(prompt_ids=tuple(rng.integers(1, 256, 8).tolist()),
                                   max_tokens=cfg.max_seq_len - 16, ignore_eos=True))
               for _ in range(cfg.running)]
    while not all(len(h.timing.token_times) >= 4 for h in running):
        time.sleep(0.005)
    t0 = time.monotonic()
    for _ in range(cfg.arrivals):
        h = orch.submit(Request(prompt_ids=tuple(rng.integers(1, 256, cfg.prompt_len).tolist()),
                                max_tokens=1, ignore_eos=True))
        h.result()
    t1 = time.monotonic()
    # Each stream's first token after the window closes it: cancelling before it would
    # leave a stall across the whole window out of the figure.
    while not all(h.timing.token_times[-1] > t1 for h in running):
        time.sleep(0.005)
    for h in running:
        h.cancel()
    gaps = []
    for h in running:
        times = np.asarray(h.result().timing.token_times)
        # From the last token before the first arrival to the first one after the last
        # arrival's first token: a stall across the whole window counts as one gap.
        lo = max(int(np.searchsorted(times, t0, side="right")) - 1, 0)
        hi = int(np.searchsorted(times, t1, side="left"))
        gaps += np.diff(times[lo:hi + 1]).tolist()
    return gaps


def run(cfg: ChunkedConfig, log: Callable[..., None] = print) -> dict:
    engine = build_engine(cfg.model, engine_config=EngineConfig(
        max_concurrent_decodes=cfg.running + 1, max_prefill_length=cfg.prompt_len,
        max_seq_len=cfg.max_seq_len, top_logprobs=0))
    params = engine.load_params()
    rows = {}
    for name, chunk in (("whole", None), ("chunked", cfg.chunk)):
        orch = Orchestrator.from_engines(engine, params=params,
                                         config=OrchestratorConfig(prefill_chunk=chunk))
        with orch:
            for timed in (False, True):
                rng = np.random.default_rng(0)
                log(f"{name}: {'measuring' if timed else 'compiling'} ...")
                gaps = _workload(orch, dataclasses.replace(cfg, arrivals=1) if not timed
                                 else cfg, rng)
        ms = np.asarray(gaps) * 1e3
        rows[name] = {"gaps": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
                      "p99_ms": round(float(np.percentile(ms, 99)), 2),
                      "max_ms": round(float(ms.max()), 2)}
    return {"config": dataclasses.asdict(cfg), "rows": rows,
            "p99_ratio": round(rows["whole"]["p99_ms"] / rows["chunked"]["p99_ms"], 2)}

"""Warm-up before serving: compile every program a request can need, before the first one.

One step per prefill bucket: a throwaway request whose prompt falls in that bucket runs
through the orchestrator, compiling the bucket's prefill (and its prompt scoring when the
engine scores prompts), insert, and generate (which is the verify step under speculative
decoding; a paged KV cache compiles one generate per gather width, and the steps reach
the widths that prompts of those lengths need). The first step's prompt is one token, so
the narrowest paged width is compiled too. Programs read from the persistent compile cache
(jetserve/compile_cache.py) count apart.

Concurrency: `run` blocks its caller (`jetserve serve` runs it on a thread of its own
while the servers answer health checks) and only submits to the orchestrator and waits
on the handles; `stop` ends it between steps.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

from jetserve.compile_cache import CompileCounter


@dataclasses.dataclass(frozen=True)
class Step:
    label: str  # what /health shows while it compiles
    prompt_len: int


def plan(orch: Any) -> list[Step]:
    """The warm-up's steps for this orchestrator: one per prefill bucket."""
    buckets = orch.prefill_engines[0].prefill_buckets()
    longest = min(orch.max_prompt_length, orch.max_seq_len - 1)  # room for a token
    steps: list[Step] = []
    for i, b in enumerate(buckets):
        n = 1 if i == 0 else min(b, longest)
        if n not in {s.prompt_len for s in steps}:
            steps.append(Step(f"prompt bucket {b}", n))
    return steps


def scores_prompts(orch: Any) -> bool:
    return all(hasattr(e, "prompt_logprobs") for e in orch.prefill_engines)


def run(orch: Any, *, on_plan: Callable[[list[str]], None] = lambda steps: None,
        on_step: Callable[[], None] = lambda: None, stop: threading.Event | None = None,
        progress: bool | None = None) -> CompileCounter:
    """Runs every step (`orch` started); returns what was compiled. progress: a tqdm bar
    on stderr (None: only when stderr is a terminal)."""
    from tqdm import tqdm

    steps = plan(orch)
    on_plan([s.label for s in steps])
    score = scores_prompts(orch)
    with CompileCounter() as counted, tqdm(total=len(steps), desc="warming up", unit="step",
                                           file=sys.stderr, disable=_disable(progress),
                                           leave=False) as bar:
        for s in steps:
            if stop is not None and stop.is_set():
                break
            bar.set_postfix_str(s.label, refresh=True)
            orch.warmup(prompt_lengths=(s.prompt_len,), prompt_logprobs=score)
            on_step()
            bar.update(1)
    return counted


def _disable(progress: bool | None) -> bool | None:
    return None if progress is None else not progress  # tqdm: None = off unless a TTY

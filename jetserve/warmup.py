"""Warm-up before serving: compile every program a request can need, before the first one.

One step per prefill bucket: a throwaway request whose prompt falls in that bucket runs
through the orchestrator, compiling the bucket's prefill (and its prompt scoring when the
engine scores prompts), insert, and generate (which is the verify step under speculative
decoding). A paged KV cache compiles one generate per gather width (pages): more steps,
with prompts just past each width's half, cover the widths a prompt can reach; wider ones
(sequences that grew past the longest prompt) still compile when first needed. The first
step's prompt is one token, so the narrowest width is compiled too. Where a prefill call
takes several prompts (--prefill-batch), one step per (prompts, bucket) shape runs it;
where the generate step has smaller batch sizes (--decode-batch-sizes), one step per size
runs it over empty slots. Programs read from the persistent compile cache
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
    score: bool  # also score the prompt (prompt log-probs; one pass up to max_prefill_length)
    shape: tuple[int, int] | None = None  # a mixed step's (tokens, pages), run alone
    rows: tuple[int, int] | None = None  # a prefill call's (prompts, bucket), run alone
    batch: int | None = None  # a generate step over the first `batch` slots, run alone


def plan(orch: Any) -> list[Step]:
    """The warm-up's steps for this orchestrator: one per prefill bucket, then (paged KV)
    one per generate width that no bucket's prompt reaches but some prompt can. Mixed
    steps (orchestrator/mixed.py): one per (token bucket, page-table width)."""
    if hasattr(orch, "warmup_shapes"):
        return [Step(f"mixed step {t} tokens x {w} pages", 0, False, shape=(t, w))
                for t, w in orch.warmup_shapes()]
    buckets = orch.prefill_engines[0].prefill_buckets()
    longest = min(orch.max_prompt_length, orch.max_seq_len - 1)  # room for a token
    scores = scores_prompts(orch)
    steps: list[Step] = []
    for i, b in enumerate(buckets):
        n = 1 if i == 0 else min(b, longest)
        if n not in {s.prompt_len for s in steps}:
            steps.append(Step(f"prompt bucket {b}", n, scores))
    steps += [Step(f"prefill {r} prompts x {b}", 0, False, rows=(r, b))
              for r, b in getattr(orch, "prefill_row_shapes", list)()]
    gen = orch.generate_engines[0]
    if hasattr(orch, "warm_decode_batch"):
        steps += [Step(f"generate batch {b}", 0, False, batch=b)
                  for b in gen.decode_batch_sizes[:-1]]
    if not hasattr(gen, "generate_widths"):
        return steps
    ps, widths = gen.kv_pages.page_size, gen.generate_widths()

    def width(n: int) -> int:  # the first generate step holds n + 1 tokens
        pages = -(-(n + 1) // ps)
        return next((w for w in widths if w >= pages), widths[-1])

    covered = {width(s.prompt_len) for s in steps if s.rows is None}
    for w in widths:
        n = (w // 2) * ps  # one token past w / 2 pages: the step's width is w
        if w not in covered and 1 <= n <= longest:
            # Past max_prefill_length prompts are scored in chunks: a program of its own,
            # compiled when first asked for rather than at every start.
            steps.append(Step(f"generate width {w} pages", n,
                              scores and n <= orch.max_prefill_length))
            covered.add(width(n))
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
    with CompileCounter() as counted, tqdm(total=len(steps), desc="warming up", unit="step",
                                           file=sys.stderr, disable=_disable(progress),
                                           leave=False) as bar:
        for s in steps:
            if stop is not None and stop.is_set():
                break
            bar.set_postfix_str(s.label, refresh=True)
            if s.shape is not None:
                orch.warm_shape(*s.shape)
            elif s.rows is not None:
                orch.warm_prefill_rows(*s.rows)
            elif s.batch is not None:
                orch.warm_decode_batch(s.batch)
            else:
                orch.warmup(prompt_lengths=(s.prompt_len,), prompt_logprobs=s.score)
            on_step()
            bar.update(1)
    return counted


def _disable(progress: bool | None) -> bool | None:
    return None if progress is None else not progress  # tqdm: None = off unless a TTY

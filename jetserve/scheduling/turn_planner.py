"""The lock-step executor's turns, decided: which slots to free, whom to admit (plain
Python, no jax).

Several processes serving one model run the same plan each turn (orchestrator/lockstep.py);
process 0 makes it here. A turn frees the slots of requests with nothing more to compute
(ended, abandoned, or their last budgeted token already dispatched), then admits waiting
requests into the lowest free slots, each only when the pages its whole sequence may take
are not promised to the running ones (`KVCacheManager.reserve`): nothing is ever preempted,
so no process has to agree on a victim. A request that does not fit stays first in line.
Scoring-only requests (max_tokens 0) take no slot. A request without a seed gets one drawn
here, so every process samples alike.

Requests are duck-typed (a LiveRequest): `done`, `abandoned(now)`,
`last_step_dispatched()`, `budget`, `request` (prompt_ids, max_tokens, sampling with
its seed, prompt_logprobs, lora_adapter) and, for structured output, `grammar` (None: free). A turn
whose step runs a constrained slot says so (`StepPlan.step_mask`), and so does each
constrained admission: the executor then takes the masks from process 0.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import Any

from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.plan import Admission, StepPlan
from jetserve.scheduling.scheduler import ended_rows


class TurnPlanner:
    """Plans the turns of one engine with `slots` decode slots over `kv`'s pages."""

    def __init__(self, slots: int, kv: KVCacheManager):
        self.slots = slots
        self.kv = kv

    def plan(self, rows: Mapping[int, Any], now: float, *,
             next_request: Callable[[bool], Any | None],
             admitted: Callable[[Any], None],
             ended: Callable[[Any, str], None]) -> tuple[StepPlan, list[Any]]:
        """One turn: (the plan, the request of each admission).

        Args:
          rows: slot -> its request, for every slot in use.
          next_request: the first waiting request (idle: nothing else to do this turn, so
            it may wait a little for one), or None.
          admitted: told when that request got into the plan (the next is asked for).
          ended: told (request, "cancelled" | "deadline") for an abandoned one it frees.
        """
        ended_now = {r.slot: r for r in ended_rows(rows.items(), now)}
        releases = []
        for slot, live in sorted(rows.items()):
            r = ended_now.get(slot)
            if r is not None or live.last_step_dispatched():
                releases.append(slot)  # nothing more to compute for it
                self.kv.unreserve(slot)
                if r is not None and r.why is not None:
                    ended(live, r.why)
        free = sorted(set(range(self.slots)) - rows.keys() | set(releases))
        admissions, lives = [], []
        while free and len(admissions) < self.slots:
            live = next_request(len(rows) == len(releases) and not admissions)
            if live is None:
                break
            slot = None if live.request.max_tokens == 0 else free[0]  # scoring: no slot
            tokens = len(live.request.prompt_ids) + live.budget
            if slot is not None and not self.kv.reserve(slot, tokens):
                break  # it waits, first in line, until running requests give pages back
            admitted(live)
            if slot is not None:
                free.pop(0)
            admissions.append(_admission(slot, live))
            lives.append(live)
        kept = [live for slot, live in rows.items() if slot not in releases]
        step_mask = any(_constrained(live) for live in kept) or any(
            a.constrained and a.slot is not None for a in admissions)
        return StepPlan(releases=tuple(releases), admissions=tuple(admissions),
                        step_mask=step_mask), lives


def _constrained(live: Any) -> bool:
    return getattr(live, "grammar", None) is not None


def _admission(slot: int | None, live: Any) -> Admission:
    request = live.request
    sp = request.sampling
    return Admission(slot=slot, prompt_ids=tuple(request.prompt_ids), sampling=sp,
                     seed=sp.seed if sp.seed is not None else secrets.randbits(31),
                     prompt_logprobs=request.prompt_logprobs,
                     constrained=slot is not None and _constrained(live),
                     adapter=getattr(request, "lora_adapter", None))

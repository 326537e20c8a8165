"""The lock-step executor's turn plans, on plain Python (fake requests, the engine's page
bookkeeping loaded from its file as in test_scheduler.py)."""

from __future__ import annotations

import dataclasses

from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.turn_planner import TurnPlanner
from tests.jetserve.scheduling.test_scheduler import slot_pages


@dataclasses.dataclass(frozen=True)
class Sampling:
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Req:
    prompt_ids: tuple[int, ...]
    max_tokens: int = 4
    sampling: Sampling = Sampling(seed=7)
    prompt_logprobs: bool = False


@dataclasses.dataclass(eq=False)
class Live:
    request: Req
    budget: int = 4
    done: bool = False
    cancelled: bool = False
    last: bool = False

    def abandoned(self, now):
        return "cancelled" if self.cancelled else None

    def last_step_dispatched(self):
        return self.last


class Queue:
    """A waiting line as the lock-step loop keeps it: the first stays until admitted."""

    def __init__(self, *lives):
        self.lives, self.idle_asks = list(lives), []

    def next(self, idle):
        self.idle_asks.append(idle)
        return self.lives[0] if self.lives else None

    def admitted(self, live):
        assert live is self.lives.pop(0)


def plan(planner, rows, queue, ended=None):
    ended = [] if ended is None else ended
    return planner.plan(rows, 0.0, next_request=queue.next, admitted=queue.admitted,
                        ended=lambda live, why: ended.append((live, why)))


def test_admits_into_the_lowest_free_slots_until_pages_run_out():
    planner = TurnPlanner(4, KVCacheManager(slot_pages(num_pages=8, max_seq_len=16)))
    a, b, c = (Live(Req(prompt_ids=(1,) * 8), budget=8) for _ in range(3))  # 4 pages each
    queue = Queue(a, b, c)
    p, lives = plan(planner, {}, queue)
    assert [x.slot for x in p.admissions] == [0, 1] and lives == [a, b]
    assert queue.lives == [c] and queue.idle_asks == [True, False, False]
    assert all(x.seed == 7 and x.prompt_ids == (1,) * 8 for x in p.admissions)
    # c waits first in line until a's slot and pages come back.
    p, lives = plan(planner, {0: a, 1: b}, queue)
    assert not p.admissions and not p.releases and queue.lives == [c]
    a.done = True
    p, lives = plan(planner, {0: a, 1: b}, queue)
    assert p.releases == (0,) and [x.slot for x in p.admissions] == [0] and lives == [c]


def test_frees_ended_abandoned_and_fully_dispatched_requests():
    planner = TurnPlanner(4, KVCacheManager(None))
    rows = {0: Live(Req((1,))), 1: Live(Req((1,)), done=True), 2: Live(Req((1,)), cancelled=True),
            3: Live(Req((1,)), last=True)}
    ended = []
    p, _ = plan(planner, rows, Queue(), ended)
    assert p.releases == (1, 2, 3) and ended == [(rows[2], "cancelled")]


def test_scoring_takes_no_slot_and_a_missing_seed_is_drawn():
    planner = TurnPlanner(2, KVCacheManager(None))  # a plan admits at most 2 prompts
    score = Live(Req((1, 2), max_tokens=0, prompt_logprobs=True), budget=0)
    gen = Live(Req((3,), sampling=Sampling(seed=None)))
    p, lives = plan(planner, {}, Queue(score, gen))
    assert [x.slot for x in p.admissions] == [None, 0] and lives == [score, gen]
    assert p.admissions[0].prompt_logprobs and 0 <= p.admissions[1].seed < 2**31

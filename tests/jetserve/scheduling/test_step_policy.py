"""The scheduling knobs (policy.py) and decode-first's token budget (step_budget.py) on
plain Python: what each knob resolves to, each refusal, and the plan and windows each
step policy makes."""

from __future__ import annotations

import threading

import pytest

from jetserve.scheduling.kv_cache_manager import KVCacheManager
from jetserve.scheduling.plan import Waiting
from jetserve.scheduling.policy import DECODE_FIRST, PREFILL_FIRST, StepPolicy, resolve
from jetserve.scheduling.scheduler import Scheduler
from jetserve.scheduling.step_budget import StepBudget

ENGINE = dict(slots=8, max_prefill_length=512, chunked_prefill=True, shares_devices=True)


class Req:
    client, done = "a", False

    def abandoned(self, now):
        return None


def test_no_knobs_is_todays_behaviour():
    p = resolve(**ENGINE)
    assert p == StepPolicy(max_num_seqs=8, prefill_chunk=512, max_num_batched_tokens=None,
                           step_policy=PREFILL_FIRST)
    assert not p.decode_first


def test_the_budget_caps_the_chunk_beside_a_full_batch_of_decodes():
    p = resolve(**ENGINE, max_num_batched_tokens=256)
    assert (p.max_num_seqs, p.prefill_chunk, p.max_num_batched_tokens) == (8, 248, 256)
    p = resolve(**ENGINE, max_num_seqs=4, max_num_batched_tokens=2048)
    assert (p.prefill_chunk, p.max_num_batched_tokens) == (512, 2048)  # at most the bucket
    p = resolve(**ENGINE, max_num_batched_tokens=200, prefill_chunk=64)
    assert p.prefill_chunk == 64


def test_decode_first_without_a_budget_lets_one_chunk_run_between_steps():
    p = resolve(**ENGINE, step_policy=DECODE_FIRST, prefill_chunk=128)
    assert p.decode_first and p.max_num_batched_tokens == 8 + 128
    p = resolve(**ENGINE, step_policy=DECODE_FIRST, max_num_seqs=2)
    assert p.max_num_batched_tokens == 2 + 512


@pytest.mark.parametrize("knobs, message", [
    (dict(max_num_seqs=16),
     r"max_num_seqs=16 \(--max-num-seqs\) is more than the engine's 8 decode slots "
     r"\(--max-concurrent-decodes\); give at most 8"),
    (dict(max_num_seqs=0), r"max_num_seqs \(--max-num-seqs\) must be an integer >= 1, got 0"),
    (dict(max_num_batched_tokens=8),
     r"max_num_batched_tokens=8 \(--max-num-batched-tokens\) leaves no prefill token "
     r"beside max_num_seqs=8 decode tokens: give at least 9"),
    (dict(max_num_batched_tokens=-1), r"max_num_batched_tokens .* got -1"),
    (dict(max_num_batched_tokens=100, prefill_chunk=128),
     r"prefill_chunk=128 \(--prefill-chunk\) .* max_num_batched_tokens=100 .* give a chunk "
     r"of at most 92 or a budget of at least 136"),
    (dict(step_policy="fcfs"),
     r"step_policy \(--step-policy\) must be one of prefill-first, decode-first; got 'fcfs'"),
    (dict(prefill_lookahead=-1),
     r"prefill_lookahead \(--prefill-lookahead\) must be an integer >= 0, got -1"),
    (dict(prefill_lookahead=8),
     r"prefill_lookahead=8 \(--prefill-lookahead\) applies to --step-policy decode-first"),
])
def test_bad_knobs_are_refused_naming_flag_value_and_limit(knobs, message):
    with pytest.raises(ValueError, match=message):
        resolve(**ENGINE, **knobs)


def test_a_budget_that_chunks_needs_an_engine_that_continues_prefixes():
    engine = {**ENGINE, "chunked_prefill": False}
    with pytest.raises(ValueError, match=r"chunks of 248 tokens.*give at least 520"):
        resolve(**engine, max_num_batched_tokens=256)
    assert resolve(**engine, max_num_batched_tokens=520).prefill_chunk == 512


def test_the_budget_and_decode_first_apply_where_prefill_shares_the_devices():
    engine = {**ENGINE, "shares_devices": False}
    for knobs in (dict(max_num_batched_tokens=600), dict(step_policy=DECODE_FIRST)):
        with pytest.raises(ValueError, match="apply to an interleaved engine"):
            resolve(**engine, **knobs)
    assert resolve(**engine, max_num_seqs=4).max_num_seqs == 4


def test_max_num_seqs_caps_the_slots_the_scheduler_hands_out():
    sched = Scheduler(resolve(**ENGINE, max_num_seqs=3).max_num_seqs, KVCacheManager(None))
    turn = sched.plan(0.0, [Waiting(Req(), 1) for _ in range(5)])
    assert [slot for slot, _ in turn.inserts] == [0, 1, 2] and not sched.slots.has_free


def test_decode_first_steps_where_prefill_first_waits_for_the_prompt():
    for decode_first, steps in ((False, False), (True, True)):
        sched = Scheduler(4, KVCacheManager(None), decode_first=decode_first)
        sched.assign(Req())
        # A free slot, nothing waiting, a prefill on its way.
        assert sched.plan(0.0, [], prefill_work=True).step is steps
        assert sched.yield_to_prefill(0, True, False) is not steps


class Live:
    """What the budget asks of the generate engine: sequences running or waiting."""

    def __init__(self, n=0):
        self.n = n


def budget(live, tokens=20, seqs=4):
    return StepBudget(tokens, seqs, lambda: live.n, stopping=threading.Event(), poll_s=0.01)


def test_a_window_holds_the_decode_tokens_and_at_most_the_rest_in_prefill():
    live = Live(2)
    b = budget(live)  # 20 tokens, at most 4 decodes
    assert b.fits(10, ends_prompt=True)  # 10 + 3 decodes
    with b.prefill(10, ends_prompt=True):
        pass
    live.n = 3  # that prompt waits for a slot now
    assert b.fits(7, ends_prompt=False)  # 10 + 7 + 3 = 20
    assert not b.fits(7, ends_prompt=True)  # its decode token too: 21
    assert not b.fits(8, ends_prompt=False)
    with b.step():  # the step closes the window
        pass
    assert b.spent == 0 and b.windows == 1 and b.fits(16, ends_prompt=True)  # 16 + 4
    assert not b.fits(17, ends_prompt=True)


def test_a_prompt_is_prefilled_only_with_a_sequence_free_for_it():
    live = Live(4)  # max_num_seqs sequences run or wait for a slot
    b = budget(live)
    assert not b.fits(1, ends_prompt=False) and not b.fits(1, ends_prompt=True)
    live.n = 3  # one finished: the next prompt may go in
    assert b.fits(12, ends_prompt=True)


def test_sequences_ending_within_the_lookahead_count_as_free_slots():
    live, ending = Live(4), Live(0)  # every sequence runs; none ends within the lookahead
    b = StepBudget(20, 4, lambda: live.n, stopping=threading.Event(), poll_s=0.01,
                   ending=lambda: ending.n)
    assert not b.fits(1, ends_prompt=True)
    ending.n = 2  # two will end within the lookahead: two prompts may wait for them
    assert b.fits(12, ends_prompt=True)
    live.n = 5
    # At most max_num_seqs decode tokens in a step, however many wait: 15 + 4 <= 20.
    assert b.fits(15, ends_prompt=True) and not b.fits(17, ends_prompt=True)
    live.n = 6  # both prefilled and waiting: no more until one ends
    assert not b.fits(1, ends_prompt=True)


def test_with_nothing_running_the_window_starts_over_at_each_call():
    live = Live(0)
    b = budget(live)
    for _ in range(5):  # a long prompt's chunks on an idle engine: no step to wait for
        with b.prefill(16, ends_prompt=False):
            pass
    assert b.spent == 16 and b.waits == 0


def test_a_prefill_that_does_not_fit_waits_for_the_next_step():
    live = Live(1)
    b = budget(live)
    with b.prefill(16, ends_prompt=False):  # 16 + 1 decode
        pass
    order = []

    def prefill():
        with b.prefill(8, ends_prompt=False):
            order.append(("prefill", b.windows))

    waiter = threading.Thread(target=prefill)
    waiter.start()
    while not b.waits:  # it found no room
        threading.Event().wait(0.005)
    order.append(("step", b.windows))
    with b.step():
        pass
    waiter.join(timeout=30)
    # It ran only once the step had closed the window, and counts in the fresh one.
    assert order == [("step", 0), ("prefill", 1)] and b.spent == 8

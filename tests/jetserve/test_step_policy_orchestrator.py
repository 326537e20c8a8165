"""The scheduling knobs take effect in the threaded orchestrator (MockEngine, whose streams
are hand-computable): under decode-first the prefill tokens run between two decode steps,
plus that step's decode tokens, never exceed --max-num-batched-tokens, while
prefill-first runs every arriving prompt before the next step; --max-num-seqs caps the
slots in use; --prefill-lookahead prefills a waiting prompt that many steps before a
running sequence's known end; bad knobs are refused when the orchestrator is built."""

from __future__ import annotations

import threading

import jax
import pytest

from engines import MockEngine
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request, StepDone

SLOTS, BUDGET = 4, 20  # a prompt chunk is at most 20 - 4 = 16 tokens
PROMPTS = [[i + 1] * 12 for i in range(3)]


def expected(prompt, n, V=256):
    t = sum(prompt) % V
    return [(t + i) % V for i in range(n)]


class Recording(MockEngine):
    """Logs each prefill call's tokens and each generate call, in call order."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls, self._lock = [], threading.Lock()

    def prefill(self, params, tokens, true_length, **kw):
        with self._lock:
            self.calls.append(int(true_length))
        return super().prefill(params, tokens, true_length, **kw)

    def generate(self, params, decode_state):
        with self._lock:
            self.calls.append("step")
        return super().generate(params, decode_state)


def windows(calls, batch_sizes):
    """(prefill tokens since the step before, that step's batch) for each step after the
    first: the windows a running sequence waited through."""
    out, tokens, k = [], 0, 0
    for c in calls:
        if c != "step":
            tokens += c
            continue
        if k > 0:
            out.append((tokens, batch_sizes[k]))
        tokens, k = 0, k + 1
    return out


def run(policy):
    # Steps that take a little wall time keep the first request running throughout.
    engine = Recording(devices=jax.devices()[:1], max_concurrent_decodes=SLOTS,
                       max_prefill_length=16, step_delay_s=0.005)
    config = OrchestratorConfig(max_num_batched_tokens=BUDGET, step_policy=policy)
    orch = Orchestrator.from_engines(engine, config=config)
    sizes = []
    orch.add_listener(lambda e: sizes.append(e.batch_size) if isinstance(e, StepDone) else None)
    with orch:
        first = orch.submit(Request(prompt_ids=[7] * 12, max_tokens=60, ignore_eos=True))
        stream = iter(first)
        next(stream), next(stream)  # it is decoding
        # All at once: none is prefilled before the others are admitted.
        handles = orch.submit_many([Request(prompt_ids=p, max_tokens=8, ignore_eos=True)
                                    for p in PROMPTS])
        got = [h.result(timeout=60).token_ids for h in handles]
        assert first.result(timeout=60).token_ids == expected([7] * 12, 60)
    assert got == [expected(p, 8) for p in PROMPTS]
    return windows(engine.calls, sizes)


def test_decode_first_keeps_every_window_within_the_budget():
    seen = run("decode-first")
    assert seen and all(tokens + batch <= BUDGET for tokens, batch in seen), seen
    # The three prompts (12 tokens each) went one window at a time.
    assert [t for t, _ in seen if t] == [12, 12, 12]


def test_prefill_first_runs_every_arriving_prompt_before_the_next_step():
    seen = run("prefill-first")
    # The running sequence waited through all three prompts: 36 tokens in one window.
    assert any(tokens == 36 for tokens, _ in seen), seen


def test_max_num_seqs_caps_the_slots_in_use():
    engine = MockEngine(devices=jax.devices()[:1], max_concurrent_decodes=SLOTS)
    orch = Orchestrator.from_engines(engine, config=OrchestratorConfig(max_num_seqs=2))
    peak = []
    orch.add_listener(lambda e: peak.append(e.batch_size) if isinstance(e, StepDone) else None)
    with orch:
        handles = orch.submit_many([Request(prompt_ids=[i + 1] * 5, max_tokens=6,
                                            ignore_eos=True) for i in range(6)])
        got = [h.result(timeout=60).token_ids for h in handles]
    assert got == [expected([i + 1] * 5, 6) for i in range(6)]
    assert max(peak) == 2 and orch.stats()["generate"][0]["slots"] == 2


@pytest.mark.parametrize("config, message", [
    (OrchestratorConfig(max_num_seqs=5), r"max_num_seqs=5 \(--max-num-seqs\).* 4 decode slots"),
    (OrchestratorConfig(max_num_batched_tokens=4),
     r"max_num_batched_tokens=4 \(--max-num-batched-tokens\).* at least 5"),
    # MockEngine cannot continue a prefix: a budget may not cut its prompts.
    (OrchestratorConfig(max_num_batched_tokens=12), r"chunks of 8 tokens.*at least 20"),
])
def test_bad_knobs_are_refused_when_the_orchestrator_is_built(config, message):
    engine = MockEngine(devices=jax.devices()[:1], max_concurrent_decodes=SLOTS,
                        max_prefill_length=16)
    with pytest.raises(ValueError, match=message):
        Orchestrator.from_engines(engine, config=config)


def test_disaggregated_refuses_decode_first():
    pe, ge = (MockEngine(devices=jax.devices()[i:i + 1]) for i in (0, 1))
    with pytest.raises(ValueError, match="apply to an interleaved engine"):
        Orchestrator(prefill_engines=[pe], generate_engines=[ge], prefill_params=[None],
                     generate_params=[None],
                     config=OrchestratorConfig(step_policy="decode-first"))


def test_config_refuses_bad_values_before_any_engine():
    with pytest.raises(ValueError, match=r"step_policy \(--step-policy\).*'fifo'"):
        OrchestratorConfig(step_policy="fifo")
    with pytest.raises(ValueError, match=r"max_num_seqs \(--max-num-seqs\).*got 0"):
        OrchestratorConfig(max_num_seqs=0)


def test_lock_step_refuses_the_knobs_it_does_not_schedule_by():
    from jetserve.orchestrator.lockstep import LockStepOrchestrator

    engine = MockEngine(devices=jax.devices()[:1])
    for config, named in ((OrchestratorConfig(step_policy="decode-first"), "step_policy"),
                          (OrchestratorConfig(max_num_seqs=2), "max_num_seqs")):
        with pytest.raises(ValueError, match=rf"{named}.*lock step over several processes"):
            LockStepOrchestrator(engine, engine.load_params(), config=config, primary=True,
                                 broadcast=lambda x: x)


def _steps_before_second_prefill(lookahead: int) -> int:
    """One slot: a running request with 30 tokens (29 steps after its prefill), then a
    second request; how many steps ran before the second one's prefill."""
    engine = Recording(devices=jax.devices()[:1], max_concurrent_decodes=1,
                       max_prefill_length=16, step_delay_s=0.02)
    config = OrchestratorConfig(step_policy="decode-first", prefill_lookahead=lookahead)
    with Orchestrator.from_engines(engine, config=config) as orch:
        first = orch.submit(Request(prompt_ids=[7] * 12, max_tokens=30, ignore_eos=True))
        stream = iter(first)
        next(stream), next(stream)  # it is decoding
        second = orch.submit(Request(prompt_ids=[3] * 5, max_tokens=4, ignore_eos=True))
        assert second.result(timeout=60).token_ids == expected([3] * 5, 4)
        assert first.result(timeout=60).token_ids == expected([7] * 12, 30)
    return engine.calls[:engine.calls.index(5)].count("step")  # 5: the second's prefill


def test_decode_first_prefills_ahead_of_a_known_end_within_the_lookahead():
    # Without a lookahead the second prompt waits for the slot: all 29 steps first.
    assert _steps_before_second_prefill(0) == 29
    # With 10 steps of lookahead it may be prefilled once the first has 10 steps left
    # (not sooner), and is, before the first's slot is free (the prefill thread wakes at
    # each step; a loaded machine may delay it a few).
    assert 19 <= _steps_before_second_prefill(10) < 29

"""Generate steps over the fewest slots (`--decode-batch-sizes`,
EngineConfig.decode_batch_sizes): the generate thread steps the smallest size that holds
every slot in use and streams exactly what full steps stream; the warm-up compiles every
size; running requests move down to free lower slots when that lets the step shrink;
`jetserve generate`'s loop and the decode role's lock step over processes pass the size
(and the moves) on; the flag's values are parsed, and refused, by name."""

import queue
import threading

import jax
import numpy as np
import pytest

from engines import EngineConfig, SamplingParams, create_engine, transformer_engine
from engines.engine_config import parse_decode_batch_sizes
from engines.kv_cache import move_slot
from jetserve import warmup
from jetserve.disagg.decode_lockstep import LockStepGenerate, follow
from jetserve.offline import generate_many
from jetserve.orchestrator import Orchestrator, OrchestratorConfig, Request
from tests.sharding.families import host_params, model_config, place

SHAPES = dict(max_concurrent_decodes=8, max_prefill_length=32, max_seq_len=64)


def _engine(sizes=()):
    return create_engine(model_config("llama"), devices=jax.devices()[:1],
                         config=EngineConfig(**SHAPES, decode_batch_sizes=sizes))


@pytest.fixture(scope="module")
def weights():
    return host_params(_engine())


def _recording(eng, monkeypatch):
    """Records the `rows` of every generate call on `eng` (None: every slot)."""
    seen = []

    def generate(*a, real=eng.generate, **k):
        seen.append(k.get("rows"))
        return real(*a, **k)

    monkeypatch.setattr(eng, "generate", generate)
    return seen


def _requests():
    # In slots 0, 1, 2 (arrival order); the last runs longest: once the first ends it
    # moves down to slot 0, and the step shrinks to two slots, then one.
    return [Request(prompt_ids=tuple(range(20, 31)), max_tokens=3, ignore_eos=True),
            Request(prompt_ids=(8, 6, 4, 2, 9), max_tokens=6, ignore_eos=True,
                    sampling=SamplingParams(temperature=0.9, seed=21)),
            Request(prompt_ids=(5, 9, 2), max_tokens=14, ignore_eos=True)]


def _serve(weights, sizes, monkeypatch, policy="prefill-first"):
    moves_traced = []  # move_slot's traces (compiles)
    monkeypatch.setattr(transformer_engine, "move_slot", lambda *a, real=move_slot: (
        moves_traced.append(1), real(*a))[1])
    eng = _engine(sizes)
    orch = Orchestrator.from_engines(eng, params=place(eng, weights),
                                     config=OrchestratorConfig(step_policy=policy))
    orch.start()
    try:
        warmup.run(orch)
        warm = eng.trace_counts()["generate"], len(moves_traced)
        seen = _recording(eng, monkeypatch)
        handles = [orch.submit(r) for r in _requests()]
        results = [h.result(300) for h in handles]
        stats = orch.stats()["generate"][0]
        compiled = eng.trace_counts()["generate"] - warm[0], len(moves_traced) - warm[1]
        return results, seen, compiled, stats
    finally:
        orch.stop()


@pytest.mark.parametrize("policy", ["prefill-first", "decode-first"])
def test_steps_take_the_fewest_slots_and_stream_what_full_steps_do(weights, monkeypatch,
                                                                    policy):
    full, rows_full, _, stats_full = _serve(weights, (), monkeypatch, policy)
    few, rows_few, compiled, stats = _serve(weights, (1, 2, 4), monkeypatch, policy)
    assert set(rows_full) == {None} and stats_full["slot_moves"] == 0
    assert [r.token_ids for r in few] == [r.token_ids for r in full]
    assert [len(r.token_ids) for r in few] == [3, 6, 14]
    # No step runs all 8 slots; the last request, alone at the end, steps as 1 slot.
    assert None not in rows_few and rows_few[-1] == 1 and stats["steps_by_batch"][1] >= 1
    if policy == "prefill-first":
        # All three prompts are inserted before the first step: slots 0-2 step as 4; the
        # last, once the others end, moves down to slot 0.
        assert 4 in rows_few and stats["slot_moves"] >= 1
    else:
        # Decode-first inserts one prompt between steps, so the step grows 1, 2, then 4
        # or back to 1 as short requests end before the next insert.
        assert max(rows_few) <= 4 and rows_few[0] == 1
    assert compiled == (0, 0)  # the warm-up compiled every size and the slot move


def test_warmup_plans_a_step_per_smaller_size():
    orch = Orchestrator.from_engines(_engine((1, 2, 4)))
    labels = [s.label for s in warmup.plan(orch)]
    assert [x for x in labels if x.startswith("generate batch")] == [
        "generate batch 1", "generate batch 2", "generate batch 4"]
    assert not [x for x in warmup.plan(Orchestrator.from_engines(_engine()))
                if x.label.startswith("generate batch")]


def test_offline_generation_steps_the_fewest_slots(weights, monkeypatch):
    prompts = [list(r.prompt_ids) for r in _requests()]
    samplings = [r.sampling for r in _requests()]
    out = {}
    for sizes in ((), (2, 4)):
        eng = _engine(sizes)
        seen = _recording(eng, monkeypatch)
        res = generate_many(eng, place(eng, weights), prompts, max_tokens=6,
                            sampling=samplings, ignore_eos=True)
        out[sizes] = ([r.token_ids for r in res], seen)
    assert out[(2, 4)][0] == out[()][0]
    # Three slots in use, then the longer two of slots 1 and 2 (the loop does not move
    # requests, so they stay in a step of 4).
    assert set(out[()][1]) == {None} and set(out[(2, 4)][1]) == {4}


def test_the_decode_roles_lock_step_passes_the_size_on(weights):
    """Process 0's turn carries `rows`; a follower replays the same step on its state."""
    lead, other = _engine((1, 2, 4)), _engine((1, 2, 4))
    p_lead, p_other = place(lead, weights), place(other, weights)
    sent: queue.Queue = queue.Queue()

    def primary(x):
        sent.put(np.asarray(x))
        return x

    done = threading.Event()
    calls = []

    def generate(*a, real=other.generate, **k):
        calls.append(k.get("rows"))
        return real(*a, **k)

    other.generate = generate
    moves = []
    other.move_slot = lambda st, src, dst, real=other.move_slot: (moves.append((src, dst)),
                                                                  real(st, src, dst))[1]
    follower = threading.Thread(target=lambda: (follow(other, p_other, None, lambda _: sent.get()),
                                                done.set()))
    follower.start()
    step = LockStepGenerate(lead, None, broadcast=primary, idle_s=60)
    state = lead.init_decode_state()
    prefix, _ = lead.prefill(p_lead, np.asarray([5, 9, 2], np.int32), 3)
    state = lead.insert(prefix, state, 0)  # process 0's own slot (a follower's stays empty)
    for rows in (1, None, 2):
        state, _ = step.generate(p_lead, state, rows=rows)
    state = step.move_slot(state, 0, 3)
    state, _ = step.generate(p_lead, state, rows=4)
    step.close()
    follower.join(60)
    assert done.is_set() and calls == [1, None, 2, 4] and moves == [(0, 3)]


@pytest.mark.parametrize("text,slots,want", [
    ("auto", 8, (1, 2, 4)), ("auto", 5, (1, 2, 4)), ("auto", 1, ()), ("none", 8, ()),
    ("4, 1,2,2", 8, (1, 2, 4)),
])
def test_the_flag_is_parsed(text, slots, want):
    assert parse_decode_batch_sizes(text, slots) == want


@pytest.mark.parametrize("text,match", [
    ("8", r"each be in \[1, 8\)"), ("0,2", r"each be in \[1, 8\)"),
    ("two", "comma-separated integers, got 'two'"),
])
def test_bad_values_are_refused_by_name(text, match):
    with pytest.raises(ValueError, match=match):
        parse_decode_batch_sizes(text, 8)

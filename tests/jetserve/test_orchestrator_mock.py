"""The orchestrator on MockEngine: exact streams, interleaved and disaggregated.

MockEngine's arithmetic (engines/mock_engine.py): the first token is sum(prompt) mod 256,
each next one is the previous + 1 mod 256, log-prob of t is -(t mod 4)/4, and token id i
is the byte i. So every stream below is known exactly.
"""

import asyncio
import time

import jax
import numpy as np
import pytest

from engines import MockEngine
from engines.mock_engine import ByteTokenizer
from jetserve.orchestrator import (
    Orchestrator,
    OrchestratorConfig,
    Overloaded,
    Request,
    RequestFinished,
    StepDone,
)

MODES = ["interleaved", "disaggregated"]


def expected(prompt, n, V=256):
    t = sum(prompt) % V
    return [(t + i) % V for i in range(n)]


def logprob(t):
    return -(t % 4) / 4


def make(mode, *, config=None, generate_engines=1, **engine_kw):
    devs = jax.devices()
    if mode == "interleaved":
        return Orchestrator.from_engines(MockEngine(devices=devs[:1], **engine_kw), config=config)
    pe = MockEngine(devices=devs[:1], **engine_kw)
    ges = [MockEngine(devices=devs[4 + i:5 + i], **engine_kw) for i in range(generate_engines)]
    return Orchestrator(prefill_engines=[pe], generate_engines=ges,
                        prefill_params=[pe.load_params()],
                        generate_params=[g.load_params() for g in ges], config=config)


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def wait_until(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


# ---- exact streams ----------------------------------------------------------------------


def test_each_delta_is_one_token_with_its_text_and_logprob(mode):
    with make(mode) as orch:
        h = orch.submit(Request(prompt_ids=[30, 35], max_tokens=5, logprobs=0))
        deltas = list(h)
    toks = expected([30, 35], 5)
    assert toks == [65, 66, 67, 68, 69]
    assert [d.token_ids for d in deltas] == [[t] for t in toks]
    assert [d.text for d in deltas] == list("ABCDE")
    assert [d.logprobs for d in deltas] == [[logprob(t)] for t in toks]
    assert [d.top_logprobs for d in deltas] == [[[]]] * 5
    assert [d.finish_reason for d in deltas] == [None] * 4 + ["length"]


def test_many_concurrent_requests_get_exactly_their_tokens(mode):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, rng.integers(1, 40)).tolist() for _ in range(24)]
    lens = rng.integers(1, 30, len(prompts)).tolist()
    with make(mode, generate_engines=2 if mode == "disaggregated" else 1) as orch:
        hs = [orch.submit(Request(prompt_ids=p, max_tokens=n))
              for p, n in zip(prompts, lens, strict=True)]
        results = [h.result(30) for h in hs]
        stats = orch.stats()
    for p, n, r in zip(prompts, lens, results, strict=True):
        assert r.token_ids == expected(p, n) and r.finish_reason == "length"
        assert r.text == ByteTokenizer().decode(r.token_ids)
    assert all(g["slots_in_use"] == 0 for g in stats["generate"])
    if mode == "disaggregated":  # both generate engines served
        assert all(g["tokens"] > 0 for g in stats["generate"])


def test_max_seq_len_caps_the_stream(mode):
    with make(mode, max_seq_len=20) as orch:
        r = orch.submit(Request(prompt_ids=[1] * 15, max_tokens=50)).result(10)
    assert r.token_ids == expected([1] * 15, 5) and r.finish_reason == "length"


def test_eos_ends_with_the_eos_id_and_no_text(mode):
    with make(mode, eos_ids=(70,)) as orch:
        deltas = list(orch.submit(Request(prompt_ids=[65], max_tokens=20)))
        ignored = orch.submit(Request(prompt_ids=[65], max_tokens=8, ignore_eos=True)).result(10)
        by_id = orch.submit(Request(prompt_ids=[65], max_tokens=8, stop_token_ids=(67,))).result(10)
    assert [d.token_ids[0] for d in deltas] == [65, 66, 67, 68, 69, 70]
    assert "".join(d.text for d in deltas) == "ABCDE" and deltas[-1].text == ""
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", 70)
    assert ignored.token_ids == expected([65], 8) and ignored.finish_reason == "length"
    assert (by_id.token_ids, by_id.text, by_id.stop_reason) == ([65, 66, 67], "AB", 67)


def test_first_token_can_end_the_request(mode):
    with make(mode, eos_ids=(65,)) as orch:
        r = orch.submit(Request(prompt_ids=[65], max_tokens=5)).result(10)
        one = orch.submit(Request(prompt_ids=[66], max_tokens=1)).result(10)
    assert (r.token_ids, r.text, r.finish_reason) == ([65], "", "stop")
    assert (one.token_ids, one.text, one.finish_reason) == ([66], "B", "length")


def test_stop_string_spanning_tokens_is_held_back_and_never_sent(mode):
    with make(mode) as orch:
        deltas = list(orch.submit(Request(prompt_ids=[65], max_tokens=20,
                                          stop_strings=("DE", "XYZ"))))
        late = orch.submit(Request(prompt_ids=[65], max_tokens=4, stop_strings=("DE",))).result(5)
    assert [d.token_ids for d in deltas] == [[65], [66], [67], [68], [69]]
    assert [d.text for d in deltas] == ["A", "B", "C", "", ""]
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("stop", "DE")
    # Ended by length while "D" was held back as a possible stop: it is released.
    assert (late.text, late.finish_reason) == ("ABCD", "length")


# ---- lifecycle --------------------------------------------------------------------------


def test_cancel_frees_the_slot_within_one_step(mode):
    with make(mode, max_concurrent_decodes=1, step_delay_s=0.002) as orch:
        first = orch.submit(Request(prompt_ids=[10], max_tokens=100))
        second = orch.submit(Request(prompt_ids=[20], max_tokens=6))
        got = []
        it = iter(first)
        while len(got) < 5:
            got += next(it).token_ids
        first.cancel()
        steps_at_cancel = orch.stats()["generate"][0]["steps"]
        rest = list(it)
        steps_at_end = orch.stats()["generate"][0]["steps"]
        assert second.result(10).token_ids == expected([20], 6)  # took the freed slot
    got += [t for d in rest for t in d.token_ids]
    assert rest[-1].finish_reason == "cancelled" and rest[-1].token_ids == []
    assert got == expected([10], len(got)) and len(got) < 100
    # The second request waited for the slot, so between cancel() and the slot's release
    # the engine ran at most the one step that was already being dispatched.
    assert steps_at_end - steps_at_cancel <= 1


def test_cancel_while_queued_and_after_the_end(mode):
    orch = make(mode)
    h = orch.submit(Request(prompt_ids=[1], max_tokens=3))
    h.cancel()
    with orch:
        r = h.result(5)
        done = orch.submit(Request(prompt_ids=[1], max_tokens=3))
        assert done.result(5).finish_reason == "length"
        done.cancel()  # no effect once ended
        assert done.result(5).finish_reason == "length"
    assert (r.token_ids, r.finish_reason) == ([], "cancelled")


def test_overloaded_at_once_when_admission_is_full(mode):
    orch = make(mode, config=OrchestratorConfig(max_queued_requests=3))
    hs = [orch.submit(Request(prompt_ids=[i], max_tokens=2)) for i in range(3)]
    with pytest.raises(Overloaded, match="admission queue is full"):
        orch.submit(Request(prompt_ids=[9], max_tokens=2))
    assert orch.stats()["counters"]["overloaded"] == 1
    with orch:
        assert [h.result(10).token_ids for h in hs] == [expected([i], 2) for i in range(3)]
        assert orch.submit(Request(prompt_ids=[9], max_tokens=2)).result(10).token_ids == [9, 10]
    with pytest.raises(Overloaded, match="shutting down"):
        orch.submit(Request(prompt_ids=[9], max_tokens=2))


def test_deadline_ends_the_stream_with_its_reason(mode):
    with make(mode, step_delay_s=0.005, max_seq_len=4096, max_prefill_length=64) as orch:
        late = orch.submit(Request(prompt_ids=[5], max_tokens=4000,
                                   deadline=time.monotonic() + 0.2)).result(30)
        past = orch.submit(Request(prompt_ids=[5], max_tokens=4,
                                   deadline=time.monotonic() - 1)).result(10)
    assert late.finish_reason == "deadline" and 0 < len(late.token_ids) < 4000
    assert late.token_ids == expected([5], len(late.token_ids))
    assert (past.token_ids, past.finish_reason) == ([], "deadline")


class _FailingPrefill(MockEngine):
    def prefill(self, params, tokens, true_length, **kw):
        if int(np.asarray(tokens)[0]) == 13:
            raise RuntimeError("bad prompt")
        return super().prefill(params, tokens, true_length, **kw)


class _FailingTokenizer(ByteTokenizer):
    def id_to_bytes(self, i):
        if i == 99:
            raise UnicodeError("cannot decode 99")
        return super().id_to_bytes(i)


def test_an_exception_ends_only_its_request():
    eng = _FailingPrefill(devices=jax.devices()[:1], max_concurrent_decodes=2)
    eng._tok = _FailingTokenizer()
    with Orchestrator.from_engines(eng) as orch:
        bad = orch.submit(Request(prompt_ids=[13], max_tokens=5))
        text_bad = orch.submit(Request(prompt_ids=[97], max_tokens=10))
        good = [orch.submit(Request(prompt_ids=[i], max_tokens=6)) for i in (1, 2, 3)]
        r_bad, r_text = bad.result(10), text_bad.result(10)
        assert [g.result(10).token_ids for g in good] == [expected([i], 6) for i in (1, 2, 3)]
        stats = orch.stats()
    assert (r_bad.finish_reason, r_bad.error) == ("error", "RuntimeError: bad prompt")
    assert r_text.finish_reason == "error" and "cannot decode 99" in r_text.error
    assert r_text.token_ids == [97, 98]  # the failing token itself is not delivered
    assert stats["generate"][0]["slots_in_use"] == 0 and stats["in_flight"] == 0


def test_async_stream_and_disconnect(mode):
    async def consume(orch):
        h = orch.submit(Request(prompt_ids=[65], max_tokens=4))
        deltas = [d async for d in h.stream()]
        gone = orch.submit(Request(prompt_ids=[1], max_tokens=100))
        async for _ in gone.stream():
            break  # the client went away
        return deltas, gone

    with make(mode, step_delay_s=0.002) as orch:
        deltas, gone = asyncio.run(consume(orch))
        r = gone.result(10)
    assert "".join(d.text for d in deltas) == "ABCD"
    assert r.finish_reason == "cancelled" and r.token_ids == expected([1], len(r.token_ids))


def test_stop_without_drain_cancels_in_flight(mode):
    orch = make(mode, step_delay_s=0.002)
    orch.start()
    h = orch.submit(Request(prompt_ids=[1], max_tokens=100))
    next(iter(h))
    orch.stop(drain=False)
    r = h.result(0)
    assert r.finish_reason == "cancelled" and r.token_ids == expected([1], len(r.token_ids))
    assert orch.stats()["in_flight"] == 0


def test_stop_drains_by_default(mode):
    orch = make(mode)
    orch.start()
    hs = [orch.submit(Request(prompt_ids=[i], max_tokens=10)) for i in range(10)]
    orch.stop()
    orch.stop()  # a second stop is a no-op
    assert [h.result(0).token_ids for h in hs] == [expected([i], 10) for i in range(10)]


def test_interleaved_prefill_has_priority_while_slots_are_free():
    orch = make("interleaved", max_concurrent_decodes=4)
    batches = []
    orch.add_listener(lambda e: batches.append(e.batch_size) if isinstance(e, StepDone) else None)
    hs = [orch.submit(Request(prompt_ids=[i], max_tokens=5)) for i in range(4)]
    with orch:
        for h in hs:
            h.result(10)
    # All four were prefilled and inserted before the first generate step.
    assert batches[0] == 4 and batches == [4] * len(batches)


def test_listeners_and_timing(mode):
    events = []
    with make(mode) as orch:
        orch.add_listener(events.append)
        r = orch.submit(Request(prompt_ids=[3, 4], max_tokens=4, request_id="r1")).result(10)
    fin = [e for e in events if isinstance(e, RequestFinished)]
    assert [(e.request_id, e.finish_reason, e.prompt_tokens, e.completion_tokens)
            for e in fin] == [("r1", "length", 2, 4)]
    t = r.timing
    assert t.arrival <= t.prefill_start <= t.prefill_end <= t.first_token <= t.end
    assert len(t.token_times) == 4 and t.token_times == sorted(t.token_times)
    assert any(isinstance(e, StepDone) for e in events)


def test_submit_validates_against_the_model(mode):
    orch = make(mode, max_prefill_length=16)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        orch.submit(Request(prompt_ids=[300]))
    with pytest.raises(ValueError, match="max_prefill_length=16"):
        orch.submit(Request(prompt_ids=[1] * 17))
    with pytest.raises(ValueError, match="logprobs=2"):
        orch.submit(Request(prompt_ids=[1], logprobs=2))
    with pytest.raises(ValueError, match="cannot score prompts"):
        orch.submit(Request(prompt_ids=[1], prompt_logprobs=True))
    orch.submit(Request(prompt_ids=[1], request_id="x"))
    with pytest.raises(ValueError, match="already in flight"):
        orch.submit(Request(prompt_ids=[1], request_id="x"))
    orch.stop()


def test_request_validation_names_the_field():
    for kw, field in [({"prompt_ids": []}, "prompt_ids"), ({"prompt_ids": [-1]}, "prompt_ids"),
                      ({"max_tokens": 0}, "max_tokens"), ({"stop_strings": ("",)}, "stop_strings"),
                      ({"stop_strings": "x"}, "stop_strings"), ({"logprobs": -1}, "logprobs"),
                      ({"deadline": float("nan")}, "deadline"), ({"sampling": 0.5}, "sampling")]:
        with pytest.raises(ValueError, match=field):
            Request(**{"prompt_ids": [1], **kw})
    assert Request(prompt_ids=[1], max_tokens=0, prompt_logprobs=True).max_tokens == 0
    assert Request(prompt_ids=[1, 2]).prompt_ids == (1, 2)


class _FailingStep(MockEngine):
    fail_next = False

    def generate(self, params, decode_state):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        return super().generate(params, decode_state)


def test_a_failed_step_ends_its_batch_and_the_engine_goes_on():
    eng = _FailingStep(devices=jax.devices()[:1], max_concurrent_decodes=2, step_delay_s=0.002)
    with Orchestrator.from_engines(eng) as orch:
        hs = [orch.submit(Request(prompt_ids=[i], max_tokens=100)) for i in (1, 2)]
        for h in hs:
            next(iter(h))
        eng.fail_next = True
        rs = [h.result(10) for h in hs]
        after = orch.submit(Request(prompt_ids=[7], max_tokens=5)).result(10)
    for i, r in zip((1, 2), rs, strict=True):
        assert (r.finish_reason, r.error) == ("error", "RuntimeError: device lost")
        assert r.token_ids == expected([i], len(r.token_ids))
    assert after.token_ids == expected([7], 5) and after.finish_reason == "length"

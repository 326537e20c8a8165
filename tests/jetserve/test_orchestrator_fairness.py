"""Fair admission on MockEngine: a client's short request is not stuck behind another
client's many long ones, a client beyond its share is refused while others get in, and
the samples of one request are admitted whole or not at all.

Order is measured by the order of prefills (a recording engine), never by time.
"""

import jax
import numpy as np
import pytest

from engines import MockEngine
from jetserve.orchestrator import (
    Orchestrator,
    OrchestratorConfig,
    Overloaded,
    Request,
    driver,
    generate_worker,
)
from jetserve.orchestrator.fair_queue import FairQueue
from jetserve.orchestrator.lockstep import LockStepOrchestrator
from jetserve.scheduling.scheduler import FairShare
from jetserve.server.streams import submit_all
from tests.jetserve.test_orchestrator_mock import expected, wait_until

A_PROMPTS = 24  # client A's requests: far more than slots + backlog can hold
B_PROMPT = 200  # client B's one request; A's prompts are 10..33


class RecordingEngine(MockEngine):
    """Adds ("prefill", first token of the prompt) to `events` on every prefill."""

    def __init__(self, events: list, **kw):
        super().__init__(**kw)
        self.events = events

    def prefill(self, params, tokens, true_length, **kw):
        self.events.append(("prefill", int(np.asarray(tokens).reshape(-1)[0])))
        return super().prefill(params, tokens, true_length, **kw)

    def insert(self, prefix, decode_state, slot, **kw):
        self.events.append(("insert", int(np.asarray(prefix.token))))
        return super().insert(prefix, decode_state, slot, **kw)


def recording_queue(events: list, fifo: bool = False) -> type[FairQueue]:
    """The admission queue, adding ("queued", client) to `events` once a client's requests
    are in; fifo: one lane for everyone, as admission was before (what the ordering test
    must catch)."""

    class Recording(FairQueue):
        def put_all_nowait(self, items, client=""):
            super().put_all_nowait(items, "" if fifo else client)
            events.append(("queued", client))

    return Recording


def make(mode, config=None, events=None):
    """(orchestrator, its prefill engine) on MockEngine: 2 slots, steps of 5 ms."""
    devs = jax.devices()
    events = [] if events is None else events
    kw = dict(max_concurrent_decodes=2, max_seq_len=512, step_delay_s=0.005)
    if mode == "lockstep":
        e = RecordingEngine(events, devices=devs[:1], **kw)
        return LockStepOrchestrator(e, e.load_params(), config=config, primary=True,
                                    broadcast=lambda x: x, idle_wait_s=0.01), e
    if mode == "interleaved":
        e = RecordingEngine(events, devices=devs[:1], **kw)
        return Orchestrator.from_engines(e, config=config), e
    pe, ge = RecordingEngine(events, devices=devs[:1], **kw), MockEngine(devices=devs[4:5], **kw)
    return Orchestrator(prefill_engines=[pe], generate_engines=[ge],
                        prefill_params=[pe.load_params()], generate_params=[ge.load_params()],
                        config=config), pe


def a_prefills_ahead_of_b(mode, monkeypatch, fifo=False) -> tuple[int, int]:
    """Client A asks for many generations at once (24 x 40 tokens on 2 slots); once they
    run, client B asks for 2 tokens. Returns (A's requests queued just before B asked,
    A's prefills after B's request was in the queue and before B's own)."""
    events: list = []
    monkeypatch.setattr(driver, "FairQueue", recording_queue(events, fifo))
    orch, engine = make(mode, events=events)
    with orch:
        a = orch.submit_many([Request(prompt_ids=[10 + i], max_tokens=40, ignore_eos=True,
                                      client="A") for i in range(A_PROMPTS)])
        wait_until(lambda: len(events) >= 3, timeout=30)  # A's are prefilling
        queued = orch.stats()["admission_queue"]
        b = orch.submit(Request(prompt_ids=[B_PROMPT], max_tokens=2, client="B"))
        first = next(iter(b))  # B's first token
        assert first.token_ids == [B_PROMPT]
        for h in a:
            h.cancel()
        assert b.result(60).token_ids == expected([B_PROMPT], 2)
    arrived, served = events.index(("queued", "B")), events.index(("prefill", B_PROMPT))
    return queued, sum(kind == "prefill" for kind, _ in events[arrived:served])


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated", "lockstep"])
def test_a_short_request_waits_for_at_most_one_of_another_clients_queued(mode, monkeypatch):
    queued, ahead = a_prefills_ahead_of_b(mode, monkeypatch)
    assert queued >= 4  # B really arrived behind a queue of A's
    # The prefill thread may have taken one of A's just before B arrived; no more.
    assert ahead <= 1, f"{ahead} of client A's requests were prefilled before B's"


def test_the_ordering_check_catches_a_fifo_queue(monkeypatch):
    # One lane for everyone, as before: B waits behind every queued request of A.
    queued, ahead = a_prefills_ahead_of_b("interleaved", monkeypatch, fifo=True)
    assert ahead >= queued - 2 >= 2


def test_a_client_beyond_its_share_is_refused_while_others_get_in():
    orch, _ = make("interleaved", OrchestratorConfig(max_queued_requests=8,
                                                     max_queued_per_client=3))
    samples = lambda client, n, first=1: [Request(prompt_ids=[first + i], max_tokens=2,
                                                  client=client) for i in range(n)]
    a = submit_all(orch, samples("A", 2))
    with pytest.raises(Overloaded, match="client's share .* full \\(2 of 3"):
        submit_all(orch, samples("A", 2, first=20))  # 2 + 2 > 3: neither goes in
    assert orch.stats()["admission_queue"] == 2 and orch.stats()["in_flight"] == 2
    a += submit_all(orch, samples("A", 1, first=30))  # what fits the share still does
    b = submit_all(orch, samples("B", 3, first=40))
    c = submit_all(orch, samples("C", 2, first=50))
    with pytest.raises(Overloaded, match="admission queue is full"):
        submit_all(orch, samples("D", 1, first=60))  # 8 queued: the total bound holds
    with pytest.raises(ValueError, match="4 sub-requests .* at most 3 per client"):
        submit_all(orch, samples("D", 4))  # never fits: not a retry-later
    with pytest.raises(ValueError, match="2 clients"):
        orch.submit_many(samples("A", 1) + samples("B", 1))
    assert orch.stats()["counters"]["overloaded"] == 2
    with orch:
        got = [h.result(30).token_ids for h in a + b + c]
    firsts = [1, 2, 30, 40, 41, 42, 50, 51]
    assert got == [expected([f], 2) for f in firsts]
    assert orch.stats()["in_flight"] == 0 and orch.stats()["admission_queue"] == 0


def test_a_client_id_is_a_bounded_string():
    with pytest.raises(ValueError, match="client must be a string"):
        Request(prompt_ids=[1], client=7)
    with pytest.raises(ValueError, match="client is 300 characters"):
        Request(prompt_ids=[1], client="x" * 300)
    with pytest.raises(ValueError, match="max_queued_per_client=9 is more than"):
        OrchestratorConfig(max_queued_requests=8, max_queued_per_client=9)


@pytest.mark.parametrize("argv, share", [
    ((), 128),  # half of the default 256
    (("--max-queued-requests", "10"), 5),
    (("--max-queued-requests", "1"), 1),
    (("--max-queued-per-client", "7"), 7),
])
def test_serve_gives_each_client_a_share_of_the_queue(monkeypatch, argv, share):
    from jetserve import orchestrator
    from jetserve.cli import build_parser
    from jetserve.commands import serve

    seen = {}
    monkeypatch.setattr(orchestrator, "build", lambda model, **kw: seen.update(kw))
    serve.build_orchestrator(build_parser().parse_args(["serve", "--model", "random:tiny",
                                                        *argv]))
    assert seen["config"].max_queued_per_client == share
    with pytest.raises(ValueError, match="--max-queued-per-client must be in"):
        serve.build_orchestrator(build_parser().parse_args(
            ["serve", "--max-queued-per-client", "300"]))


def test_a_group_with_an_id_in_flight_or_twice_goes_in_not_at_all():
    orch, _ = make("interleaved")
    orch.submit(Request(prompt_ids=[1], request_id="x", client="A"))
    for ids in (["y", "x"], ["z", "z"]):
        with pytest.raises(ValueError, match="already in flight"):
            orch.submit_many([Request(prompt_ids=[1], request_id=i, client="A") for i in ids])
    assert orch.stats()["in_flight"] == 1 and orch.stats()["admission_queue"] == 1
    orch.stop(drain=False)


def a_inserts_ahead_of_b(mode, backlog_fifo: bool, monkeypatch) -> tuple[int, int]:
    """Client A's 24 long requests fill 2 slots and a backlog of 6 prefilled ones; then
    client B asks for 2 tokens. Returns (A's requests in the backlog when B's prefix went
    in, A's inserts after that and before B's own), from the order of recorded events."""
    events: list = []
    put = generate_worker.Backlog.put

    def recording_put(self, item, stopping, poll_s):
        with self._cond:  # re-entrant: put's own wait releases it while the backlog is full
            ok = put(self, item, stopping, poll_s)
            # Under the lock the generate thread's picks take: ordered with them.
            events.append(("backlog", item[0].request.prompt_ids[0], len(self._items) - 1))
        return ok

    monkeypatch.setattr(generate_worker.Backlog, "put", recording_put)
    if backlog_fifo:  # slots handed out in arrival order, as before: every rank equal
        monkeypatch.setattr(FairShare, "rank", lambda self, request: 0)
    devs = jax.devices()
    kw = dict(max_concurrent_decodes=SLOTS, max_seq_len=512, step_delay_s=0.005)
    config = OrchestratorConfig(backlog_size=6)
    if mode == "interleaved":
        e = RecordingEngine(events, devices=devs[:1], **kw)
        orch = Orchestrator.from_engines(e, config=config)
    else:
        pe = MockEngine(devices=devs[:1], **kw)
        gen = RecordingEngine(events, devices=devs[4:5], **kw)
        orch = Orchestrator(prefill_engines=[pe], generate_engines=[gen],
                            prefill_params=[pe.load_params()],
                            generate_params=[gen.load_params()], config=config)
    with orch:
        # Long enough (400 steps of >= 5 ms) that the backlog cannot drain while B's
        # prefill waits for the CPU on a loaded machine. One token more for each later A:
        # two A's never end in the same step, so no turn frees both slots at once (there A
        # and B would both hold none, and the older A's tie-win would be counted "ahead"
        # of B although B gets the other slot in that same turn).
        a = orch.submit_many([Request(prompt_ids=[10 + i], max_tokens=400 + i,
                                      ignore_eos=True, client="A") for i in range(A_PROMPTS)])
        wait_until(lambda: orch.stats()["generate"][0]["backlog"] >= 6, timeout=60)
        b = orch.submit(Request(prompt_ids=[B_PROMPT], max_tokens=2, client="B"))
        assert b.result(120).token_ids == expected([B_PROMPT], 2)
        for h in a:
            h.cancel()
    (entered, waiting), = [(k, e[2]) for k, e in enumerate(events)
                           if e[:2] == ("backlog", B_PROMPT)]
    later = events[entered + 1:]
    served = later.index(("insert", B_PROMPT))
    return waiting, sum(e[0] == "insert" for e in later[:served])


# Once B's prefix is in the backlog, every slot that frees is B's first. Only A's already
# picked for free slots before it went in (at most the 2 slots) are inserted ahead of it.
# (A's end one step apart, so slots free one at a time; a turn that frees two gives one
# to each client: tests/jetserve/scheduling/test_scheduler.py checks that tie.)
SLOTS = 2


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
def test_a_free_slot_goes_to_the_client_holding_fewest(mode, monkeypatch):
    waiting, ahead = a_inserts_ahead_of_b(mode, False, monkeypatch)
    assert waiting > SLOTS  # B's prefix went in behind a backlog of A's
    assert ahead <= SLOTS, f"{ahead} of A's waiting requests went before B"


@pytest.mark.parametrize("mode", ["interleaved", "disaggregated"])
def test_the_slot_order_check_catches_a_fifo_backlog(mode, monkeypatch):
    waiting, ahead = a_inserts_ahead_of_b(mode, True, monkeypatch)
    assert ahead >= waiting > SLOTS  # every A that was waiting went first

"""The read-back path the executors share: one step late, finishes, failures."""

from __future__ import annotations

import queue

import numpy as np

from jetserve.orchestrator.live import EndRequest, LiveRequest, StepOutput
from jetserve.orchestrator.readback import ReadBack
from jetserve.orchestrator.timing import Listeners, RequestTiming, StepDone
from jetserve.request import Request

STOP = 9


class Host:
    """A step's results on the host: one token per slot."""

    def __init__(self, tokens):
        self.data = np.asarray(tokens, np.int32)[:, None]
        self._tokens = tokens

    def tokens(self, slot):
        return [self._tokens[slot]]

    def drafts(self, slot):
        return (0, 0)


class Step:
    def __init__(self, tokens, fails=False):
        self.tokens, self.fails = tokens, fails

    def to_host(self):
        if self.fails:
            raise RuntimeError("device lost")
        return Host(self.tokens)


def live(budget=3):
    return LiveRequest(Request(prompt_ids=(1, 2), max_tokens=budget), handle=None,
                       timing=RequestTiming(arrival=0.0), budget=budget,
                       stop_ids=frozenset({STOP}))


def drain(q):
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_a_step_is_read_when_the_next_is_dispatched_and_a_stop_id_finishes():
    outbox, events, finished = queue.Queue(), [], []
    listeners = Listeners()
    listeners.add(events.append)
    rb = ReadBack(3, outbox, listeners, finished=lambda slot, lv: finished.append((slot, lv)))
    a, b = live(), live()
    rb.dispatched(Step([5, 6]), [(0, a), (1, b)], 0.0)
    assert drain(outbox) == []  # still on its way to the host
    rb.dispatched(Step([7, STOP]), [(0, a), (1, b)], 0.0)
    (first,) = drain(outbox)
    assert isinstance(first, StepOutput) and [r[2:] for r in first.rows] == [(1, None)] * 2
    rb.read()
    (second,) = drain(outbox)
    assert [(r[0], r[1], r[3]) for r in second.rows] == [(a, 0, None), (b, 1, ("stop", STOP))]
    assert finished == [(1, b)] and b.done and not a.done
    assert a.tokens == [5, 7] and b.tokens == [6, STOP] and rb.tokens == 4
    assert [type(e) for e in events] == [StepDone, StepDone] and events[0].engine == 3
    rb.dispatched(Step([8, 8]), [(0, a), (1, b)], 0.0)
    rb.read()
    (third,) = drain(outbox)  # b ended: its row is dropped; a reaches its budget
    assert [(r[0], r[3]) for r in third.rows] == [(a, ("length", None))]


def test_a_failed_read_ends_the_step_requests_with_the_error():
    outbox = queue.Queue()
    rb = ReadBack(0, outbox, Listeners())
    a, b = live(), live()
    b.done = True
    rb.dispatched(Step([1, 1], fails=True), [(0, a), (1, b)], 0.0)
    rb.read()
    (end,) = drain(outbox)
    assert isinstance(end, EndRequest) and end.live is a and end.reason == "error"
    assert "device lost" in end.error and rb.pending is None


def test_fail_ends_each_request_once_pending_step_included():
    outbox = queue.Queue()
    rb = ReadBack(0, outbox, Listeners())
    a, b, c = live(), live(), live()
    rb.dispatched(Step([1, 1]), [(0, a), (1, b)], 0.0)
    rb.fail(ValueError("bad step"), [b, c, None])
    ends = drain(outbox)
    assert {id(e.live) for e in ends} == {id(a), id(b), id(c)} and len(ends) == 3
    assert all(e.reason == "error" and e.error == "ValueError: bad step" for e in ends)
    assert rb.pending is None

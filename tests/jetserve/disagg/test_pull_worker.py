"""The decode side's pull stage with a stand-in receiver and workers (no second process):
a pulled prefix goes to the backlog and is acknowledged; a pull that fails because the
worker went away sends the request back to be prefilled again, until its retries run
out; a prefix that does not fit the engine ends its request with the named error."""

import queue
import threading

from jetserve.disagg.kv_transfer import PullTimeout
from jetserve.disagg.prefill_client import Worker
from jetserve.disagg.prefix_wire import PrefixMismatch
from jetserve.disagg.pull_worker import PullWorker
from jetserve.disagg.remote_prefill import Ticket
from jetserve.orchestrator.live import EndRequest, LiveRequest
from jetserve.orchestrator.timing import RequestTiming
from jetserve.request import Request

META = {"leaves": [{"shape": [1, 4, 2, 8], "dtype": "float32"}]}  # 256 bytes


class _Engine:
    def prefix_destination_sharding(self):
        return None


class _Backlog:
    def __init__(self):
        self.items = []

    def put(self, item, stopping, poll_s):
        self.items.append(item)
        return True


class _Target:
    def __init__(self):
        self.engine, self.backlog, self.index = _Engine(), _Backlog(), 0


class _Workers:
    def __init__(self):
        self.acked, self.down = [], []

    def ack(self, worker, uuid):
        self.acked.append((worker.address, uuid))

    def mark_down(self, worker):
        self.down.append(worker.address)


class _Receiver:
    timeout_s = 30.0

    def __init__(self, outcome):
        self.outcome = outcome

    def pull(self, address, uuid, meta, who):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


def _stage(outcome, max_retries=2):
    resumed, outbox, workers = [], queue.Queue(), _Workers()
    w = PullWorker(_Target(), _Receiver(outcome), workers, outbox, resumed.append,
                   threading.Event(), queue_size=4, poll_s=0.01, max_bytes_in_flight=1 << 20,
                   max_retries=max_retries)
    return w, resumed, outbox, workers


def _live() -> LiveRequest:
    live = LiveRequest(request=Request(prompt_ids=(1, 2, 3)), handle=None,
                       timing=RequestTiming(arrival=0.0), budget=8, stop_ids=frozenset())
    live.take([7])  # the first token already streamed
    return live


TICKET = Ticket(Worker("worker-a:1", stub=None), "127.0.0.1:5", 42, META)


def _pull(w: PullWorker, live: LiveRequest) -> None:
    assert w.budget.take(256, w.stopping, 0.01)
    w._pull(live, TICKET, 256)
    assert w.budget.used == 0 and w.pending() == 0


def test_pulled_prefix_goes_to_the_backlog_and_is_acknowledged():
    w, resumed, outbox, workers = _stage("PREFIX")
    live = _live()
    _pull(w, live)
    assert w.target.backlog.items == [(live, "PREFIX")]
    assert workers.acked == [("worker-a:1", 42)] and not resumed and outbox.empty()
    assert w.stats.snapshot()["bytes"] == 256 and w.stats.snapshot()["pulls"] == 1


def test_failed_pull_is_prefilled_again_keeping_its_tokens():
    w, resumed, outbox, workers = _stage(RuntimeError("connection closed"))
    live = _live()
    _pull(w, live)
    assert resumed == [live] and live.preemptions == 1
    assert live.sequence() == [1, 2, 3, 7]  # the next prefill continues after the token
    assert workers.down == ["worker-a:1"] and outbox.empty()
    assert workers.acked == [("worker-a:1", 42)]  # freed at once if the worker is still there
    assert w.stats.snapshot()["retries"] == 1


def test_failed_pulls_end_the_request_once_its_retries_ran_out():
    w, resumed, outbox, _ = _stage(RuntimeError("connection closed"), max_retries=1)
    live = _live()
    live.preempted()  # retried once already
    _pull(w, live)
    end = outbox.get_nowait()
    assert not resumed and isinstance(end, EndRequest) and end.reason == "error"
    assert "failed 2 times, last from worker-a:1" in end.error and live.done


def test_prefix_that_does_not_fit_ends_its_request_with_the_named_error():
    w, resumed, outbox, workers = _stage(PrefixMismatch("worker-a makes prefixes with "
                                                        "num_layers=4, this engine takes 2"))
    live = _live()
    _pull(w, live)
    end = outbox.get_nowait()
    assert end.reason == "error" and "num_layers=4" in end.error
    assert not resumed and not w.target.backlog.items
    assert workers.acked == [("worker-a:1", 42)]  # the worker frees what nobody will pull


def test_cancelled_request_is_not_pulled_but_freed():
    w, resumed, outbox, workers = _stage(AssertionError("must not pull"))
    live = _live()
    live.cancel_requested = True
    _pull(w, live)
    assert outbox.get_nowait().reason == "cancelled"
    assert workers.acked == [("worker-a:1", 42)] and not resumed


def test_pull_from_a_hung_worker_times_out_and_is_prefilled_again():
    # KVReceiver gives up on a hung pull (test_kv_transfer.py); the stage retries it.
    w, resumed, outbox, workers = _stage(PullTimeout("no prefix from worker-a:1 after 0.2 s"))
    live = _live()
    _pull(w, live)
    assert resumed == [live] and live.preemptions == 1 and outbox.empty()
    assert workers.down == ["worker-a:1"]

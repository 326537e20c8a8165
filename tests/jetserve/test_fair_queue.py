"""The admission queue (jetserve/orchestrator/fair_queue.py): clients served in turn, the
total bound, each client's share, all-or-none groups, and threads that share it."""

import queue
import threading
import time

import pytest

from jetserve.orchestrator.fair_queue import ClientFull, FairQueue, Full


def drain(q: FairQueue) -> list:
    out = []
    while q.qsize():
        out.append(q.get_nowait())
    return out


def test_clients_are_served_in_turn_each_in_its_own_order():
    q = FairQueue(16)
    q.put_all_nowait(["a1", "a2", "a3", "a4"], "A")
    q.put_nowait("b1", "B")
    q.put_all_nowait(["c1", "c2"], "C")
    assert drain(q) == ["a1", "b1", "c1", "a2", "c2", "a3", "a4"]


def test_a_newcomer_goes_next_after_the_client_just_served():
    # One long lane: a client arriving behind it waits for no more of it.
    q = FairQueue(16)
    q.put_all_nowait([f"a{i}" for i in range(10)], "A")
    assert q.get_nowait() == "a0"
    q.put_nowait("b0", "B")
    q.put_nowait("c0", "C")
    assert [q.get_nowait() for _ in range(3)] == ["b0", "c0", "a1"]
    # A lane that emptied and fills again rejoins as a newcomer.
    q.put_nowait("b1", "B")
    assert [q.get_nowait() for _ in range(2)] == ["b1", "a2"]


def test_the_per_client_share_refuses_only_that_client():
    q = FairQueue(10, per_client=3)
    q.put_all_nowait(["a1", "a2", "a3"], "A")
    with pytest.raises(ClientFull):
        q.put_nowait("a4", "A")
    q.put_all_nowait(["b1", "b2", "b3"], "B")  # others still get in
    assert (q.held_by("A"), q.held_by("B"), q.qsize(), q.clients()) == (3, 3, 6, 2)
    assert q.get_nowait() == "a1"
    q.put_nowait("a4", "A")  # room again once one of A's is taken
    assert q.held_by("A") == 3


def test_the_total_bound_holds_across_clients():
    q = FairQueue(4, per_client=3)
    q.put_all_nowait(["a1", "a2", "a3"], "A")
    q.put_nowait("b1", "B")
    with pytest.raises(Full):
        q.put_nowait("c1", "C")
    assert q.qsize() == 4 and q.held_by("C") == 0


def test_a_group_goes_in_whole_or_not_at_all():
    q = FairQueue(6, per_client=4)
    q.put_all_nowait(["a1", "a2"], "A")
    with pytest.raises(ClientFull):
        q.put_all_nowait(["a3", "a4", "a5"], "A")  # 2 + 3 > 4: none of the three
    assert q.held_by("A") == 2
    q.put_all_nowait(["b1", "b2", "b3"], "B")
    with pytest.raises(Full):
        q.put_all_nowait(["a3", "a4"], "A")  # fits A's share, not the total (5 + 2 > 6)
    assert (q.held_by("A"), q.qsize(), q.unfinished_tasks) == (2, 5, 5)
    q.put_nowait("a3", "A")
    assert drain(q) == ["a1", "b1", "a2", "b2", "a3", "b3"]


def test_task_done_and_unfinished_tasks_count_what_is_not_yet_handed_on():
    q = FairQueue(4)
    q.put_all_nowait([1, 2], "A")
    assert q.get_nowait() == 1
    assert (q.qsize(), q.unfinished_tasks) == (1, 2)  # 1 taken, not yet handed on
    q.task_done()
    q.get_nowait()
    q.task_done()
    assert (q.qsize(), q.unfinished_tasks) == (0, 0)
    with pytest.raises(ValueError, match="task_done"):
        q.task_done()


def test_get_waits_for_an_item_or_raises_empty():
    q = FairQueue(4)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)
    threading.Timer(0.05, lambda: q.put_nowait("x", "A")).start()
    assert q.get(timeout=30) == "x"  # woken by the put, long before the bound


def test_bad_bounds_are_refused_naming_them():
    with pytest.raises(ValueError, match="maxsize"):
        FairQueue(0)
    with pytest.raises(ValueError, match="per_client"):
        FairQueue(4, per_client=0)
    assert FairQueue(4, per_client=10).per_client == 4  # a share is part of the whole


def test_producers_and_consumers_on_threads_lose_and_repeat_nothing():
    producers, per_producer, consumers = 4, 300, 2
    q = FairQueue(32, per_client=12)
    got: list[list[tuple[str, int]]] = [[] for _ in range(consumers)]
    end = time.monotonic() + 60
    refused = [0] * producers

    def produce(p: int) -> None:
        client, i = f"c{p}", 0
        while i < per_producer and time.monotonic() < end:
            n = min(1 + i % 3, per_producer - i)  # groups of 1..3
            try:
                q.put_all_nowait([(client, i + k) for k in range(n)], client)
                i += n
            except queue.Full:
                refused[p] += 1
                time.sleep(0.0005)

    def consume(c: int) -> None:
        while len(got[0]) + len(got[1]) < producers * per_producer and time.monotonic() < end:
            try:
                got[c].append(q.get(timeout=0.01))
            except queue.Empty:
                continue
            q.task_done()

    threads = ([threading.Thread(target=produce, args=(p,)) for p in range(producers)]
               + [threading.Thread(target=consume, args=(c,)) for c in range(consumers)])
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)
    items = got[0] + got[1]
    assert sorted(items) == sorted((f"c{p}", i) for p in range(producers)
                                   for i in range(per_producer))
    for c in range(consumers):  # each consumer sees every client's items in its order
        for p in range(producers):
            mine = [i for client, i in got[c] if client == f"c{p}"]
            assert mine == sorted(mine)
    assert (q.qsize(), q.unfinished_tasks, q.clients()) == (0, 0, 0)

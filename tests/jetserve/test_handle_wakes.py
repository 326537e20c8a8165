"""Async readers of many handles are woken once per event loop for a step's deltas."""

import asyncio
import threading

from jetserve.orchestrator.handle import RequestHandle, Wakes
from jetserve.orchestrator.timing import RequestTiming
from jetserve.request import Delta, Request


def _handle() -> RequestHandle:
    return RequestHandle(Request(prompt_ids=(1, 2), max_tokens=4), RequestTiming(arrival=0.0),
                         on_cancel=lambda: None)


def _delta(i: int, final: bool = False) -> Delta:
    return Delta(token_ids=[i], text=str(i), finish_reason="length" if final else None)


def test_one_wake_per_loop_and_every_reader_gets_its_deltas():
    handles = [_handle() for _ in range(5)]
    crossings = []

    async def main():
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (crossings.append(a), real(*a))[1]
        got = {i: [] for i in range(len(handles))}

        async def read(i):
            async for d in handles[i].stream():
                got[i].append(d.token_ids[0])

        readers = [asyncio.ensure_future(read(i)) for i in range(len(handles))]
        await asyncio.sleep(0.05)  # every reader waits on its future

        def writer():  # the detokenize thread: two steps, then a final delta each
            for step in range(3):
                wakes = Wakes()
                for i, h in enumerate(handles):
                    h._push(_delta(10 * i + step, final=step == 2), step == 2, wakes)
                wakes.flush()

        t = threading.Thread(target=writer)
        t.start()
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        t.join()
        return got

    got = asyncio.run(main())
    assert got == {i: [10 * i, 10 * i + 1, 10 * i + 2] for i in range(5)}
    # At most one crossing per step (a reader not yet waiting again needs none).
    assert 1 <= len(crossings) <= 3


def test_push_without_wakes_wakes_at_once():
    h = _handle()

    async def main():
        reader = asyncio.ensure_future(_first(h))
        await asyncio.sleep(0.05)
        threading.Thread(target=h._push, args=(_delta(7, final=True), True)).start()
        return await asyncio.wait_for(reader, 10)

    assert asyncio.run(main()) == [7]
    assert h.done


async def _first(h: RequestHandle) -> list[int]:
    return [t async for d in h.stream() for t in d.token_ids]


def test_flush_to_a_closed_loop_is_ignored():
    h = _handle()
    loop = asyncio.new_event_loop()
    fut = loop.create_future()
    h._waiters.append((loop, fut))
    loop.close()
    wakes = Wakes()
    h._push(_delta(1, final=True), True, wakes)
    wakes.flush()  # the reader's loop is gone: nothing to wake, no error
    assert h.result(timeout=1).token_ids == [1]

"""merge(): batches of deltas across samples, nothing lost, unfinished requests cancelled."""

import asyncio
import contextlib

import pytest

from jetserve.request import Delta
from jetserve.server.streams import BUFFER, ShuttingDown, StreamCut, join, merge


class FakeHandle:
    """Yields its deltas in bursts (several at once, as RequestHandle.stream may)."""

    def __init__(self, n_tokens: int, burst: int = 3, hang: bool = False):
        self.deltas = [Delta([i], str(i), finish_reason="length" if i == n_tokens - 1 else None)
                       for i in range(n_tokens)]
        self.burst, self.hang = burst, hang
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    async def stream(self):
        for k in range(0, len(self.deltas), self.burst):
            for d in self.deltas[k:k + self.burst]:
                yield d  # no await between: they arrive together
            await asyncio.sleep(0)
        if self.hang:
            await asyncio.Event().wait()


def test_merge_delivers_every_delta_once_per_batch_index():
    handles = [FakeHandle(7), FakeHandle(4, burst=4), FakeHandle(1)]

    async def run():
        batches = []
        async for batch in merge(handles):
            batches.append(batch)
        return batches

    batches = asyncio.run(run())
    for batch in batches:
        idx = [i for i, _ in batch]
        assert len(idx) == len(set(idx))  # one delta per sample per message
    for i, h in enumerate(handles):
        assert [d for b in batches for j, d in b if j == i] == h.deltas
    assert not any(h.cancelled for h in handles)
    joined = asyncio.run(join([FakeHandle(5)]))
    assert joined[0].token_ids == [0, 1, 2, 3, 4] and joined[0].finish_reason == "length"


def test_leaving_early_cancels_unfinished_requests():
    handles = [FakeHandle(2), FakeHandle(50, hang=True)]

    async def run():
        async with contextlib.aclosing(merge(handles)) as batches:
            async for batch in batches:
                if any(i == 1 for i, _ in batch):
                    break  # a client that disconnects
        return handles[1].cancelled  # before the loop ends

    assert asyncio.run(run())


class CountingHandle(FakeHandle):
    """A FakeHandle whose whole backlog is ready at once; counts what was pulled from it."""

    def __init__(self, n_tokens: int):
        super().__init__(n_tokens, burst=n_tokens)
        self.pulled = 0

    async def stream(self):
        for d in self.deltas:
            self.pulled += 1
            yield d


def test_ready_backlog_drains_in_order_and_lets_the_loop_run_between_batches():
    # 16 samples x 1,000 deltas all ready at once (a reader that fell behind): every
    # delta arrives in order, and another coroutine runs between any two batches.
    samples, tokens = 16, 1000
    handles = [CountingHandle(tokens) for _ in range(samples)]

    async def run():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        seen, ticks_at = [[] for _ in range(samples)], []
        async for batch in merge(handles):
            ticks_at.append(ticks)
            for i, d in batch:
                seen[i].append(d)
        t.cancel()
        return seen, ticks_at

    seen, ticks_at = asyncio.run(run())
    for i, h in enumerate(handles):
        assert seen[i] == h.deltas
    stalls = sum(b <= a for a, b in zip(ticks_at, ticks_at[1:], strict=False))
    assert stalls == 0, f"{stalls} of {len(ticks_at)} batches came without the loop running"


def test_buffering_per_sample_is_bounded_while_the_reader_waits():
    handles = [CountingHandle(1000), CountingHandle(1000)]

    async def run():
        async with contextlib.aclosing(merge(handles)) as batches:
            await batches.__anext__()
            for _ in range(10):  # the reader is busy elsewhere; the pumps keep running
                await asyncio.sleep(0)
            return [h.pulled for h in handles]

    pulled = asyncio.run(run())
    assert all(p <= BUFFER + 1 for p in pulled), pulled
    assert all(h.cancelled for h in handles)


def test_a_cut_ends_the_merge_with_shutting_down_and_cancels_requests():
    handles = [FakeHandle(3, hang=True), FakeHandle(3, hang=True)]

    async def run():
        cut = StreamCut()
        got = []
        with pytest.raises(ShuttingDown):
            async for batch in merge(handles, cut=cut):
                got.extend(batch)
                if len(got) == 6:  # everything ready has arrived; the streams now hang
                    asyncio.get_running_loop().call_later(0.01, cut.fire)
        return got

    assert len(asyncio.run(run())) == 6
    assert all(h.cancelled for h in handles)

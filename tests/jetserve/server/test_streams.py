"""merge(): batches of deltas across samples, nothing lost, unfinished requests cancelled."""

import asyncio
import contextlib

from jetserve.request import Delta
from jetserve.server.streams import join, merge


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

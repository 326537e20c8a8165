"""WriteDeadline: each write of a stream bounded by the timeout, with one timer."""

import asyncio

import pytest

from jetserve.server.write_deadline import WriteDeadline


async def _stream(deadline: WriteDeadline, delays: list[float]) -> list[int]:
    """Writes whose i-th takes delays[i] seconds; returns the indices that completed."""
    done = []
    for i, d in enumerate(delays):
        await deadline.write(asyncio.sleep(d))
        done.append(i)
    return done


def test_writes_each_under_the_timeout_pass_though_together_they_exceed_it():
    async def main():
        d = WriteDeadline(0.2)
        try:
            return await _stream(d, [0.05] * 10)  # 0.5 s in all, 0.05 s each
        finally:
            d.close()

    assert asyncio.run(main()) == list(range(10))


def test_a_write_held_past_the_timeout_raises_timeout_as_asyncio_timeout_does():
    async def ours():
        d = WriteDeadline(0.2)
        t0 = asyncio.get_running_loop().time()
        done: list[int] = []
        with pytest.raises(TimeoutError):
            for i, s in enumerate([0.15, 0.15, 5.0]):  # the third write is held
                await d.write(asyncio.sleep(s))
                done.append(i)
        d.close()
        return done, asyncio.get_running_loop().time() - t0

    async def reference():
        done: list[int] = []
        with pytest.raises(TimeoutError):
            for i, s in enumerate([0.15, 0.15, 5.0]):
                async with asyncio.timeout(0.2):
                    await asyncio.sleep(s)
                done.append(i)
        return done

    done, took = asyncio.run(ours())
    assert done == asyncio.run(reference()) == [0, 1]
    # The third write began at ~0.3 s: it is given up at its own deadline (~0.5 s), not
    # at the first write's (~0.2 s) nor never.
    assert 0.45 <= took < 3.0


def test_an_outside_cancel_stays_a_cancel():
    async def main():
        d = WriteDeadline(10.0)
        task = asyncio.ensure_future(d.write(asyncio.sleep(5.0)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        d.close()
        assert d._timer is None

    asyncio.run(main())

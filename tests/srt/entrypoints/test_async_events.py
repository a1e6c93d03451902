"""The loop thread's events into asyncio (engine_client._AsyncEvents / _Mailbox): every
submission gets its own events in order, a burst from the loop thread wakes the asyncio loop
once, a cancelled waiter loses no event, and a dead loop thread is noticed."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from srt.entrypoints import engine_client
from srt.entrypoints.engine_client import _AsyncEvents


class _Loop:
    alive = True


def test_events_arrive_in_order_per_submission_and_a_burst_wakes_once(monkeypatch):
    monkeypatch.setattr(engine_client, "_POLL_S", 0.05)
    n, steps = 37, 11
    wakeups = []

    async def main():
        aio = asyncio.get_running_loop()
        real = aio.call_soon_threadsafe

        def counting(cb, *args):
            wakeups.append(cb)
            return real(cb, *args)

        aio.call_soon_threadsafe = counting  # type: ignore[method-assign]
        evs = [_AsyncEvents() for _ in range(n)]
        got: list[list[int]] = [[] for _ in range(n)]
        step_done = [threading.Event() for _ in range(steps)]

        async def consume(i):
            for _ in range(steps):
                got[i].append((await evs[i].next(_Loop()))[1])

        def producer():
            rng = random.Random(0)
            for s in range(steps):
                for i in rng.sample(range(n), n):  # any order across submissions
                    evs[i].sink(("chunk", s))
                step_done[s].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(n)]
        th = threading.Thread(target=producer)
        th.start()
        await asyncio.gather(*tasks)
        th.join()
        return got

    got = asyncio.run(main())
    assert got == [list(range(11))] * n
    assert 1 <= len(wakeups) <= 11 * 37 // 4  # bursts, not one wake-up per event


def test_cancelled_waiter_loses_no_event_and_a_dead_loop_is_noticed(monkeypatch):
    monkeypatch.setattr(engine_client, "_POLL_S", 0.02)

    async def main():
        ev = _AsyncEvents()
        task = asyncio.create_task(ev.next(_Loop()))
        await asyncio.sleep(0.01)
        task.cancel()
        ev.sink(("chunk", 1))  # races with the cancellation
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert await ev.next(_Loop()) == ("chunk", 1)
        dead = _Loop()
        dead.alive = False
        with pytest.raises(RuntimeError, match="engine loop stopped"):
            await ev.next(dead)
        ev.close()

    asyncio.run(main())

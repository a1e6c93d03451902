"""The callers' side of an Engine's EngineLoop: submit checked requests and wait for them.

`Engine.generate` and `Engine.async_generate` build and check their requests on the caller's
thread, then hand them to the engine's loop thread, which alone runs the model, and wait for
their events (engine_loop.py). Any number of threads and coroutines may call at once: their
requests join the same continuous batch, and each caller gets exactly its own outputs.

A caller that stops waiting (an exception, Ctrl-C, a stream closed early, a cancelled task)
cancels its submission and waits until the loop has aborted its requests, so their KV slots
are free when the call returns. A waiting caller also notices a loop thread that died.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from srt.entrypoints.engine_loop import EngineLoop, Submission
from srt.entrypoints.request_builder import PreparedBatch
from srt.managers.schedule_batch import Req

_POLL_S = 0.2  # how often a waiting caller checks that the loop thread is alive
_CANCEL_WAIT_S = 120.0  # at most this long for the loop to abort a cancelled submission


class _Collector:
    """One submission's events -> outputs (and chunks): raises what the caller must raise."""

    def __init__(self, batch: PreparedBatch) -> None:
        self.batch = batch
        self.outputs: list[dict[str, Any]] = [{} for _ in batch.items]
        self.left = len(batch.items)

    def _raise_single_failure(self) -> None:
        """A single request that failed inside a step raises its error (a list call has it
        as that entry's `error`)."""
        item = self.batch.items[0] if self.batch.single else None
        if isinstance(item, Req) and item.error is not None:
            raise item.error

    def feed(self, event: tuple) -> dict[str, Any] | None:
        """Take one event; returns a chunk to stream, if it is one."""
        kind = event[0]
        if kind in ("error", "fatal"):
            raise event[1]
        if kind == "chunk":
            self._raise_single_failure()
            chunk = event[2]
            if not self.batch.single:
                chunk["index"] = event[1]
            return chunk
        if kind == "final":
            self.outputs[event[1]] = event[2]
            self.left -= 1
            self._raise_single_failure()
        return None

    @property
    def done(self) -> bool:
        return self.left == 0


def _next_event(loop: EngineLoop, events: queue.SimpleQueue) -> tuple:
    while True:
        try:
            return events.get(timeout=_POLL_S)
        except queue.Empty:
            if not loop.alive:
                raise RuntimeError("the engine loop stopped (engine shut down?)") from None


def _cancel(loop: EngineLoop, sub: Submission, events: queue.SimpleQueue) -> None:
    """Abort what is left of the submission and wait until the loop has done so."""
    if not loop.alive:
        return
    loop.cancel(sub)
    waited = 0.0
    while waited < _CANCEL_WAIT_S and loop.alive:
        try:
            if events.get(timeout=_POLL_S)[0] == "cancelled":
                return
        except queue.Empty:
            waited += _POLL_S


def run(loop: EngineLoop, batch: PreparedBatch, progress: Any = None) -> list[dict[str, Any]]:
    """Run the batch's requests; their output dicts in order (`progress.update(1)` each)."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    sub = Submission({}, events.put, batch=batch)
    out = _Collector(batch)
    loop.submit(sub)
    try:
        while not out.done:
            left = out.left
            out.feed(_next_event(loop, events))
            if progress is not None and out.left < left:
                progress.update(left - out.left)
    except BaseException:
        _cancel(loop, sub, events)
        raise
    return out.outputs


def stream(
    loop: EngineLoop, batch: PreparedBatch, incremental: bool | None = None
) -> Iterator[dict[str, Any]]:
    """The batch's chunks as they come (`index` in a list call); closing the iterator early
    aborts the requests still running. Nothing is submitted before the first `next`."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    sub = Submission({}, events.put, stream=True, batch=batch, incremental=incremental)
    out = _Collector(batch)
    loop.submit(sub)
    try:
        while not out.done:
            chunk = out.feed(_next_event(loop, events))
            if chunk is not None:
                yield chunk
    except BaseException:  # GeneratorExit (closed early) included
        _cancel(loop, sub, events)
        raise


class _Mailbox:
    """The loop thread's events for every `_AsyncEvents` of one asyncio loop, handed over in
    bursts: a step's chunks for hundreds of streams wake the asyncio loop once, not once per
    event (each wake-up is a write to the loop's self-pipe and a callback, and a step's worth of
    them held the GIL that the loop thread needs for the next step)."""

    _by_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _make_lock = threading.Lock()

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self.aio = aio
        self.lock = threading.Lock()
        self.items: collections.deque = collections.deque()
        self.scheduled = False

    @classmethod
    def of(cls, aio: asyncio.AbstractEventLoop) -> _Mailbox:
        with cls._make_lock:
            box = cls._by_loop.get(aio)
            if box is None:
                box = cls._by_loop[aio] = cls(aio)
            return box

    def post(self, target: _AsyncEvents, event: tuple) -> None:  # called on the loop thread
        with self.lock:
            self.items.append((target, event))
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.aio.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the asyncio loop is closed: nobody is listening
            pass

    def _deliver(self) -> None:  # on the asyncio loop
        with self.lock:
            items, self.items = self.items, collections.deque()
            self.scheduled = False
        for target, event in items:
            target.put(event)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _AsyncEvents:
    """A submission's events delivered into an asyncio loop: a deque the mailbox fills, and a
    bare future a waiting caller sleeps on (woken by an event or by the poll timer, which
    checks that the loop thread is alive). Cancelling the caller cancels only that future:
    an event that raced with it stays in the deque."""

    def __init__(self) -> None:
        self.aio = asyncio.get_running_loop()
        self.events: collections.deque = collections.deque()
        self._mailbox = _Mailbox.of(self.aio)
        self._waiter: asyncio.Future | None = None

    def sink(self, event: tuple) -> None:  # called on the loop thread
        self._mailbox.post(self, event)

    def put(self, event: tuple) -> None:  # on the asyncio loop
        self.events.append(event)
        if self._waiter is not None:
            _wake(self._waiter)

    async def next(self, loop: EngineLoop) -> tuple:
        while not self.events:
            waiter = self._waiter = self.aio.create_future()
            timer = self.aio.call_later(_POLL_S, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
            if not self.events and not loop.alive:
                raise RuntimeError("the engine loop stopped (engine shut down?)")
        return self.events.popleft()

    def close(self) -> None:
        if self._waiter is not None:
            self._waiter.cancel()
            self._waiter = None

    async def cancel(self, loop: EngineLoop, sub: Submission) -> None:
        """Abort what is left of the submission; wait until the loop has done so."""
        if not loop.alive:
            return
        loop.cancel(sub)
        deadline = self.aio.time() + _CANCEL_WAIT_S
        try:
            while self.aio.time() < deadline and (await self.next(loop))[0] != "cancelled":
                pass
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - best effort: freed anyway
            pass


async def async_run(loop: EngineLoop, batch: PreparedBatch) -> list[dict[str, Any]]:
    """`run` for asyncio code: awaits the loop thread's events (no worker thread)."""
    events = _AsyncEvents()
    sub = Submission({}, events.sink, batch=batch)
    out = _Collector(batch)
    loop.submit(sub)
    try:
        while not out.done:
            out.feed(await events.next(loop))
    except BaseException:  # CancelledError included
        await events.cancel(loop, sub)
        raise
    finally:
        events.close()
    return out.outputs


async def async_stream(
    loop: EngineLoop, batch: PreparedBatch, incremental: bool | None = None
) -> AsyncIterator[dict[str, Any]]:
    """`stream` for asyncio code (`aclose()` early aborts the requests still running)."""
    events = _AsyncEvents()
    sub = Submission({}, events.sink, stream=True, batch=batch, incremental=incremental)
    out = _Collector(batch)
    loop.submit(sub)
    try:
        while not out.done:
            chunk = out.feed(await events.next(loop))
            if chunk is not None:
                yield chunk
    except BaseException:
        await events.cancel(loop, sub)
        raise
    finally:
        events.close()

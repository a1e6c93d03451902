"""EngineLoop: one background thread owns an Engine and its Scheduler; other threads submit.

The HTTP server's handlers run on an asyncio loop; the model runs here. A handler submits the
arguments of a `generate` call with a sink (a callable this thread hands events to); the thread
builds the requests, adds them to the continuous-batching scheduler next to every other
client's, steps it, and reports through the sink. `cancel` (a client that left) aborts the
submission's unfinished requests and frees their KV slots before the next step.

Events given to a sink, in order:
- ("error", exc): the call was malformed, or its single request was rejected; nothing else.
- ("start", count, single): count outputs will follow (single: one request, no list).
- per output i: ("chunk", i, dict) for each increment (streaming submissions only), then
  ("final", i, dict) once: the whole output (a rejected request's error entry included).
- ("fatal", exc): a forward step failed; every active request was aborted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from srt.entrypoints.outputs import RequestError, StreamState
from srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)

Sink = Callable[[tuple], None]
_IDLE_WAIT_S = 0.05


@dataclass(eq=False)
class Submission:
    """One generate call from a client (mutable: the loop thread records its request ids).

    Attributes
    ----------
    kwargs : Engine.make_requests arguments (prompt/input_ids, sampling_params,
        return_logprob).
    sink : receives the events listed in the module docstring (called on the loop thread).
    stream : also send the increments.
    rids : ids of its requests once built.
    """

    kwargs: dict[str, Any]
    sink: Sink
    stream: bool = False
    rids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Active:
    """A running request and where its events go."""

    sub: Submission
    index: int
    req: Req
    state: StreamState


class EngineLoop:
    """Runs `engine` on a daemon thread until `close()`.

    Parameters
    ----------
    engine : an Engine built with tp_size = 1 (or one rank under torchrun). With Engine-spawned
        TP workers each submission runs as one whole `generate` call, one after the other.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Submission]] = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="srt-engine-loop", daemon=True)
        self._thread.start()

    # ---- any thread ----
    def submit(self, sub: Submission) -> None:
        if self._stop.is_set():
            raise RuntimeError("the engine loop is closed")
        self._inbox.put(("submit", sub))

    def cancel(self, sub: Submission) -> None:
        """Abort what is left of a submission (its client is gone)."""
        self._inbox.put(("cancel", sub))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (the engine stays; shut it down after)."""
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def num_active(self) -> int:
        """Requests submitted and not finished (read on any thread: a snapshot)."""
        return len(self._active)

    # ---- the loop thread ----
    @staticmethod
    def _send(sub: Submission, event: tuple) -> None:
        try:
            sub.sink(event)
        except Exception:  # noqa: BLE001 - a client's broken sink must not stop the loop
            logger.exception("dropping an event for a client")

    def _handle(self, kind: str, sub: Submission) -> None:
        if kind == "cancel":
            for rid in sub.rids:
                if self._active.pop(rid, None) is not None:
                    self.engine.scheduler.abort(rid)
            return
        if self.engine.scheduler is None:  # Engine-spawned TP workers: whole calls
            self._run_whole(sub)
            return
        try:
            batch = self.engine.make_requests(**sub.kwargs)
        except (ValueError, TypeError) as e:
            self._send(sub, ("error", e))
            return
        self._send(sub, ("start", len(batch.items), batch.single))
        for i, item in enumerate(batch.items):
            if isinstance(item, RequestError):
                self._send(sub, ("final", i, self.engine.output(item)))
                continue
            sub.rids.append(item.rid)
            self.engine.scheduler.add_request(item)
            self._active[item.rid] = _Active(sub, i, item, StreamState(item, self.engine.tokenizer))

    def _run_whole(self, sub: Submission) -> None:
        try:
            out = self.engine.generate(**sub.kwargs, progress_bar=False)
        except (ValueError, TypeError) as e:
            self._send(sub, ("error", e))
            return
        except Exception as e:  # noqa: BLE001 - reported to the client
            self._send(sub, ("fatal", e))
            return
        outs = [out] if isinstance(out, dict) else out
        self._send(sub, ("start", len(outs), isinstance(out, dict)))
        for i, o in enumerate(outs):
            if sub.stream:
                self._send(sub, ("chunk", i, o))
            self._send(sub, ("final", i, o))

    def _emit(self) -> None:
        for rid, a in list(self._active.items()):
            if a.sub.stream:
                chunk = a.state.next_chunk()
                if chunk is not None:
                    self._send(a.sub, ("chunk", a.index, chunk))
            if a.req.finished:
                del self._active[rid]
                self._send(a.sub, ("final", a.index, self.engine.output(a.req)))

    def _run(self) -> None:
        while not self._stop.is_set():
            sched = self.engine.scheduler
            busy = sched is not None and sched.has_work()
            try:
                if busy:
                    kind, sub = self._inbox.get_nowait()
                else:
                    kind, sub = self._inbox.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                kind = ""
            if kind:
                try:
                    self._handle(kind, sub)
                except Exception as e:  # noqa: BLE001 - reported to that client only
                    logger.exception("could not start a submission")
                    self._send(sub, ("fatal", e))
                continue  # take every queued message before the next step
            if not busy:
                continue
            try:
                sched.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                logger.exception("forward step failed; aborting %d requests", len(self._active))
                sched.abort_all()
                subs = {id(a.sub): a.sub for a in self._active.values()}
                self._active.clear()
                for s in subs.values():
                    self._send(s, ("fatal", e))
                continue
            self._emit()

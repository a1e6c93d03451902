"""EngineLoop: one background thread owns an Engine and its Scheduler; other threads submit.

Every caller of an Engine (`generate` from any thread, `async_generate` coroutines, the HTTP
server's handlers) submits here; the model runs only on this thread. A submission carries the
arguments of a `generate` call, or its requests already built (`Submission.batch`), and a sink
(a callable this thread hands events to); the thread adds the requests to the continuous-
batching scheduler next to every other client's, steps it, and reports through the sink.
`cancel` (a client that left, a closed stream) aborts the submission's unfinished requests and
frees their KV slots before the next step, then sends ("cancelled",).

Events given to a sink, in order:
- ("error", exc): the call was malformed, or its single request was rejected; nothing else.
- ("start", count, single): count outputs will follow (single: one request, no list).
- per output i: ("chunk", i, dict) for each update (streaming submissions only: cumulative
  output so far, or the increment with `incremental`), then ("final", i, dict) once: the whole
  output (a rejected request's error entry, or one failed alone inside a step, included).
- ("fatal", exc): a step failed beyond one request (or was interrupted); every active request
  of every submission was aborted.
- ("cancelled",): after `cancel`, once the submission's requests are aborted.

`call(fn)` runs fn on this thread between two steps and returns its result (the engine's
`flush_cache` goes through it while the loop serves).
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

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
        return_logprob); unused when `batch` is given.
    sink : receives the events listed in the module docstring (called on the loop thread).
    stream : also send chunks while the requests run.
    batch : the requests already built (an Engine PreparedBatch), or None: built here.
    incremental : chunks carry only what is new since the previous one; None takes the
        engine's `server_args.incremental_streaming_output` (default False: cumulative, as
        SGLang).
    rids : ids of its requests once built.
    """

    kwargs: dict[str, Any]
    sink: Sink
    stream: bool = False
    batch: Any = None
    incremental: bool | None = None
    rids: list[str] = field(default_factory=list)


class _Call:
    """A function to run on the loop thread, and its outcome for the waiting caller."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
            self.error = e
        finally:
            self.done.set()


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
        # A weak reference: an Engine dropped without shutdown() is still collected (its
        # model and KV cache freed); the thread then ends.
        self._engine_ref = weakref.ref(engine)
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        # cancelled submissions whose aborted requests a pending step still references
        self._cancelling: list[tuple[Submission, list[Req]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="srt-engine-loop", daemon=True)
        self._thread.start()

    @property
    def engine(self) -> Any:
        engine = self._engine_ref()
        if engine is None:
            raise RuntimeError("the engine of this loop was garbage-collected")
        return engine

    # ---- any thread ----
    def submit(self, sub: Submission) -> None:
        if self._stop.is_set():
            raise RuntimeError("the engine loop is closed")
        self._inbox.put(("submit", sub))

    def call(self, fn: Callable[[], Any], timeout_s: float = 600.0) -> Any:
        """fn() run on the loop thread between two steps; its result (or its exception)."""
        if threading.current_thread() is self._thread:
            return fn()
        if self._stop.is_set():
            raise RuntimeError("the engine loop is closed")
        call = _Call(fn)
        self._inbox.put(("call", call))
        if not call.done.wait(timeout_s):
            raise TimeoutError(f"the engine loop did not run the call within {timeout_s} s")
        if call.error is not None:
            raise call.error
        return call.result

    def cancel(self, sub: Submission) -> None:
        """Abort what is left of a submission (its client is gone)."""
        self._inbox.put(("cancel", sub))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (the engine stays; shut it down after)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        """Whether the thread still serves submissions."""
        return self._thread.is_alive() and not self._stop.is_set()

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

    def _handle(self, kind: str, sub: Any) -> None:
        if kind == "call":
            sub.run()
            return
        if kind == "cancel":
            self._cancelling.append((sub, self._abort(sub)))
            self._acknowledge_cancels()
            return
        if self.engine.scheduler is None:  # Engine-spawned TP workers: whole calls
            self._run_whole(sub)
            return
        batch = sub.batch
        if batch is None:
            try:
                batch = self.engine.make_requests(**sub.kwargs)
            except (ValueError, TypeError) as e:
                self._send(sub, ("error", e))
                return
        incremental = sub.incremental
        if incremental is None:
            incremental = bool(self.engine.server_args.incremental_streaming_output)
        self._send(sub, ("start", len(batch.items), batch.single))
        for i, item in enumerate(batch.items):
            if isinstance(item, RequestError):
                self._send(sub, ("final", i, self.engine.output(item)))
                continue
            sub.rids.append(item.rid)
            self.engine.scheduler.add_request(item)
            state = StreamState(item, self.engine.tokenizer, incremental)
            self._active[item.rid] = _Active(sub, i, item, state)

    def _abort(self, sub: Submission) -> list[Req]:
        """Abort the submission's unfinished requests (their memory is freed); returns them."""
        gone = []
        for rid in sub.rids:
            a = self._active.pop(rid, None)
            if a is not None:
                self.engine.scheduler.abort(rid)
                gone.append(a.req)
        return gone

    def _held(self, req: Req) -> bool:
        sched = self.engine.scheduler
        return sched is not None and sched.holds(req)

    def _acknowledge_cancels(self) -> None:
        """("cancelled",) to each cancelled submission that no pending step references."""
        still = []
        for sub, reqs in self._cancelling:
            if any(self._held(r) for r in reqs):
                still.append((sub, reqs))
            else:
                self._send(sub, ("cancelled",))
        self._cancelling = still

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
        """Chunks and finals after a step. A request's final waits until no pending step
        references it (the overlapped decode's extra step), so when a caller has every final
        of its call the scheduler holds nothing of it."""
        for rid, a in list(self._active.items()):
            if a.sub.stream:
                chunk = a.state.next_chunk()
                if chunk is not None:
                    self._send(a.sub, ("chunk", a.index, chunk))
            if a.req.finished and not self._held(a.req):
                del self._active[rid]
                self._send(a.sub, ("final", a.index, self.engine.output(a.req)))
        self._acknowledge_cancels()

    def _set_device(self) -> None:
        runner = getattr(self.engine, "model_runner", None)
        if runner is not None and runner.device.type == "cuda":
            torch.cuda.set_device(runner.device)  # per thread: the runner's, as at its build

    def _busy(self) -> bool:
        """Whether it has work of its own. Only its submissions' work: a scheduler driven
        directly by its owner (tests, benchmarks) between calls is not stepped from here."""
        engine = self._engine_ref()
        if engine is None:  # (no local reference to it outlives this call)
            self._stop.set()
            return False
        return engine.scheduler is not None and bool(self._active or self._cancelling)

    def _run(self) -> None:
        self._set_device()
        while not self._stop.is_set():
            busy = self._busy()
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
                except BaseException as e:  # noqa: BLE001 - reported to that client only
                    logger.exception("could not start a submission")
                    try:
                        self._abort(sub)
                    finally:
                        self._send(sub, ("fatal", e))
                continue  # take every queued message before the next step
            if busy:
                self._step()

    def _step(self) -> None:
        sched = self.engine.scheduler
        if not sched.has_work():  # (nothing pending: only events left to send)
            self._emit()
            return
        try:
            sched.step()
        except BaseException as e:  # noqa: BLE001 - fail the requests, keep serving
            # (a single request's failure is isolated inside the step: this is wider, or an
            # interrupt; KeyboardInterrupt included, so the thread survives it)
            self._fail_all(sched, e)
            return
        self._emit()

    def _fail_all(self, sched: Any, error: BaseException) -> None:
        logger.error("step failed; aborting %d requests", len(self._active), exc_info=error)
        subs = {id(a.sub): a.sub for a in self._active.values()}
        self._active.clear()
        try:
            sched.abort_all()
        except BaseException:  # noqa: BLE001 - the clients still hear of the first error
            logger.exception("aborting the requests failed too")
        for s in subs.values():
            self._send(s, ("fatal", error))
        self._acknowledge_cancels()

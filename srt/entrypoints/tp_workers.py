"""One worker process per TP rank for `srt.Engine(..., tp_size=N)`.

Protocol (a `multiprocessing` pipe per rank, spawn start method): the parent sends the same
`(method, kwargs)` to every rank, every rank runs the same deterministic `Engine` method on the
same inputs (same scheduler decisions, same seeds; sampled ids are broadcast from rank 0), and
answers `("ok", result)` (rank 0's result only) or `("error", exception)`. No hangs: the parent
polls with a deadline and watches the processes; a collective stuck on a dead or failed rank
ends after `dist_timeout`. A rank failing alone leaves the group unusable, so the parent then
stops every worker and raises.
"""

from __future__ import annotations

import pickle
import socket
import time
import traceback
from multiprocessing import connection as mp_connection
from typing import Any

import torch.multiprocessing as mp

_WAIT_S = 1.0
_STOP_TIMEOUT_S = 30.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pack_error(e: BaseException) -> BaseException:
    """The exception if it pickles, else a RuntimeError carrying its traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any unpicklable exception becomes a RuntimeError
        return RuntimeError("".join(traceback.format_exception(e)))


def _worker_main(
    rank: int, tp_size: int, init_method: str, engine_cls: Any, engine_kwargs: dict, conn
) -> None:
    """Entry of a rank's process: join the TP group, build the engine (engine_cls: the Engine
    class, passed by the parent so this module does not import it), serve requests."""
    from srt.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        set_multicast_off_env,
    )

    set_multicast_off_env()  # before any NCCL communicator exists

    engine = None
    try:
        device = str(engine_kwargs.get("device") or "cpu")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        init_distributed_environment(
            tp_size,
            rank,
            init_method,
            backend,
            local_rank=rank,
            timeout_s=float(engine_kwargs.get("dist_timeout", 600.0)),
        )
        engine = engine_cls(**engine_kwargs)
        conn.send(("ok", {"eos_token_ids": engine.eos_token_ids}))
        while True:
            try:
                method, kwargs = conn.recv()
            except EOFError:  # the parent is gone
                break
            if method == "shutdown":
                break
            if method == "generate" and rank != 0:
                kwargs = {**kwargs, "progress_bar": False}  # one bar, from rank 0
            try:
                result = getattr(engine, method)(**kwargs)
                conn.send(("ok", result if rank == 0 else None))
            except Exception as e:  # noqa: BLE001 - reported to the parent
                conn.send(("error", _pack_error(e)))
    except Exception as e:  # noqa: BLE001 - start-up failure, reported to the parent
        try:
            conn.send(("error", _pack_error(e)))
        except (OSError, EOFError):
            pass
    finally:
        if engine is not None:
            engine.shutdown()
        destroy_distributed_environment()
        conn.close()


class TpWorkerGroup:
    """Starts tp_size worker processes and calls Engine methods on all of them.

    Parameters
    ----------
    tp_size : number of ranks.
    engine_cls : the Engine class each rank builds (picklable by name).
    engine_kwargs : Engine(...) arguments each rank builds its Engine with.
    dist_init_addr : "host:port" rendezvous (None: a free port on 127.0.0.1).
    timeout_s : start-up deadline, and how long the others may take to answer once one rank
        has failed.
    """

    def __init__(
        self,
        tp_size: int,
        engine_cls: Any,
        engine_kwargs: dict[str, Any],
        dist_init_addr: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.tp_size, self.timeout_s = tp_size, timeout_s
        addr = dist_init_addr or f"127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        self.closed = False
        for rank in range(tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(rank, tp_size, f"tcp://{addr}", engine_cls, engine_kwargs, child),
                name=f"srt-tp{rank}",
                daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        try:
            infos = self._gather(deadline=time.monotonic() + timeout_s)
        except BaseException:
            self.close()
            raise
        self.info: dict[str, Any] = infos[0]

    def _gather(self, deadline: float | None) -> list[Any]:
        """Every rank's answer. Raises the ranks' common error, or stops all and raises."""
        answers: dict[int, tuple[str, Any]] = {}
        while len(answers) < self.tp_size:
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"TP ranks {self._missing(answers)} did not answer in time")
            # Wake on an answer or a process exit (its sentinel), at the latest after _WAIT_S.
            waiting = [r for r in range(self.tp_size) if r not in answers]
            handles = [self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting]
            mp_connection.wait(handles, timeout=_WAIT_S)
            for r in waiting:
                c = self.conns[r]
                if c.poll(0):
                    try:
                        answers[r] = c.recv()
                    except EOFError:
                        answers[r] = ("dead", None)
                elif not self.procs[r].is_alive():
                    answers[r] = ("dead", None)
                if answers.get(r, ("ok",))[0] != "ok" and deadline is None:
                    deadline = time.monotonic() + self.timeout_s  # the others get a grace time
        kinds = {k for k, _ in answers.values()}
        if kinds == {"ok"}:
            return [answers[r][1] for r in range(self.tp_size)]
        errors = [answers[r][1] for r in range(self.tp_size) if answers[r][0] == "error"]
        if kinds == {"error"} and len({type(e) for e in errors}) == 1:
            raise errors[0]  # every rank failed the same way (e.g. bad input): still usable
        dead = [r for r in range(self.tp_size) if answers[r][0] == "dead"]
        self.close()
        msg = f"TP ranks failed (dead: {dead}); the engine is shut down"
        if errors:
            raise RuntimeError(msg) from errors[0]
        raise RuntimeError(msg)

    def _missing(self, answers: dict) -> list[int]:
        return [r for r in range(self.tp_size) if r not in answers]

    def call(self, method: str, **kwargs: Any) -> Any:
        """Run Engine.`method`(**kwargs) on every rank; rank 0's result."""
        if self.closed:
            raise RuntimeError("the TP workers are shut down")
        dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
        for r, c in enumerate(self.conns):
            if r in dead:
                continue
            try:
                c.send((method, kwargs))
            except OSError:  # BrokenPipeError: the rank is gone
                dead.append(r)
        if dead:
            self.close()
            raise RuntimeError(f"TP ranks failed (dead: {sorted(dead)}); the engine is shut down")
        return self._gather(deadline=None)[0]

    def close(self) -> None:
        """Ask every rank to stop, then terminate the ones that do not."""
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            try:
                c.send(("shutdown", {}))
            except (OSError, BrokenPipeError):
                pass
        end = time.monotonic() + _STOP_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()

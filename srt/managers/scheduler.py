"""Scheduler: continuous batching with admission control over one ModelRunner.

Each step prefills newly admitted requests (prefill first, as in SGLang), or one chunk of a long
prompt (`chunked_prefill.py`), or decodes every running request; requests join and leave the
running batch between steps (their KV slots freed for those still waiting).

Admission (`schedule_policy.py`) is conservative: a request is admitted only if the KV pool can
hold its whole future on top of what the running requests may still need, so a decode step
never runs out of memory and no request is ever retracted or lost. With a hybrid pool, window
pages are given back after every step (`evict_swa`).

Prefix cache (RadixAttention; `disable_radix_cache`): a request starts from its prompt's
longest cached prefix (whole pages, locked while it runs) and computes only the rest; its prompt
goes into the tree after its prefill (`_cache_prompts`), the rest when it finishes; one that
fails or is aborted unlocks and inserts nothing (`SWARadixCache` on the hybrid pool).

Overlapped decode (SGLang's overlap schedule; `disable_overlap_schedule` turns it off): while
decode step N runs on the GPU, the host prepares and launches step N + 1 (its input tokens
copied on the device from step N's ids) and only then waits for step N's tokens: the host's
work (slots, upload, window eviction, finish checks) hides under the GPU's. Its device effects
(scrubs, mapping writes, the next step) queue on the same stream after step N, so freeing
memory step N still reads is safe. A request known to finish by length at step N is left out
of step N + 1; one that stops on a token at step N has run one step more, whose token is
dropped (a sampled one drew once more from its generator, which nothing reads again). For
greedy and sampled requests without penalties, logit_bias or logprobs, at TP 1, none waiting.

Isolation: a step that raises an Exception is undone (every request restored from its
`ReqSnapshot`, the KV slots the step took given back) and retried in halves, down to single
requests: a request whose step still fails is finished alone (finish reason abort with the
message and status 500, `Req.error` set, its memory freed), and the others' tokens are those
of a step without it (a failed overlapped launch falls back to the step-by-step decode).
Anything else (KeyboardInterrupt, a failure while undoing) propagates: the caller aborts all.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from srt.distributed import tensor_model_parallel_broadcast
from srt.managers.chunked_prefill import ChunkedPrefillMixin
from srt.managers.inflight_step import InFlightStep
from srt.managers.req_snapshot import ReqSnapshot
from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.managers.schedule_policy import SchedulePolicy
from srt.managers.scheduler_logprobs import (
    prefill_logits,
    record_output_logprob,
    top_logprobs_nums,
    wants_input_logprobs,
)
from srt.managers.scheduler_stats import PrefixCacheStats
from srt.mem_cache.host_copy import upload
from srt.mem_cache.write_check import check_batch_writes, kv_write_checks_enabled
from srt.sampling.logit_bias import apply_logit_bias
from srt.sampling.logprobs import OutputLogprob, output_logprobs
from srt.sampling.penalties import PenaltyInputs, apply_penalties
from srt.sampling.sampler import sample, step_seed

logger = logging.getLogger(__name__)


def _penalty_inputs(req: Req) -> PenaltyInputs:
    params = req.sampling_params
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= req.eos_token_ids
    return PenaltyInputs(params, req.origin_input_ids, req.output_ids, frozenset(banned))


def _plain(req: Req) -> bool:
    """Its token needs only the logits of its own row: greedy or sampled, no penalty (or
    min_new_tokens) mask, which reads the tokens so far, no logit_bias and no logprob. Such
    requests may run in the overlapped decode."""
    params = req.sampling_params
    return not params.has_penalties and params.logit_bias is None and not req.return_logprob


def _plain_greedy(req: Req) -> bool:
    """The argmax is all its sampling needs: plain and greedy. Such batches take the runner's
    greedy ids."""
    return req.sampling_params.is_greedy and _plain(req)


def _step_seeds(reqs: list[Req]) -> list[int] | None:
    """A noise seed per request for this sampling step (its generator's seed and its draw
    count, which then advances), or None where a sampled request has no generator. The
    overlapped and the step-by-step decode draw the same seeds, so the same tokens."""
    if any(r.generator is None and not r.sampling_params.is_greedy for r in reqs):
        return None
    out = []
    for r in reqs:
        if r.generator is None:
            out.append(0)
            continue
        out.append(step_seed(r.generator.initial_seed(), r.draws))
        r.draws += 1
    return out


def _ends_by_length(req: Req) -> bool:
    """Whether the next token appended finishes the request by length (`check_finished`'s
    length conditions, one token ahead)."""
    n = len(req.output_ids) + 1
    if n >= req.sampling_params.max_new_tokens:
        return True
    return bool(req.max_total_len) and len(req.origin_input_ids) + n >= req.max_total_len


class Scheduler(ChunkedPrefillMixin):
    """Runs requests to completion on a ModelRunner.

    Parameters
    ----------
    model_runner : ModelRunner (pools, allocator, attention backend, `forward`).
    max_prefill_tokens : most prompt tokens in one prefill batch (a longer single prompt still
        runs alone).
    """

    def __init__(self, model_runner: Any, max_prefill_tokens: int = 16384) -> None:
        self.runner = model_runner
        self.page_size = model_runner.page_size
        self.max_running_requests = model_runner.max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.batch = ScheduleBatch.from_runner(model_runner)
        self.is_swa = self.batch.is_swa
        self.policy = SchedulePolicy(
            model_runner, self.page_size, self.batch.sliding_window_size, max_prefill_tokens
        )
        self.tree_cache = self.batch.tree_cache = self.policy.tree_cache
        self.chunked_req: Req | None = None  # the request prefilled in chunks (in running)
        self._chunk_turn = False  # the next step is its chunk (decodes and chunks alternate)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finished_early: list[Req] = []
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_overlapped_steps = 0  # decode steps launched before the previous one was read
        self.stats = PrefixCacheStats()  # prompt tokens admitted, and cached (the hit rate)
        self.overlap = (
            getattr(model_runner, "tp_size", 1) == 1
            and hasattr(model_runner, "greedy_ids_device")
            and not getattr(self.policy.args, "disable_overlap_schedule", True)
        )
        self._inflight: InFlightStep | None = None
        if self.overlap and self.is_swa:  # evictions' mapping resets ride on the next step
            self.batch.token_to_kv_pool.defer_mapping_resets = True
        if self.overlap:  # two host buffers of tokens: step N's is read while N + 1 writes
            pin = torch.device(model_runner.device).type == "cuda"
            rows = self.max_running_requests
            self._token_bufs = [
                torch.zeros(rows, dtype=torch.int64, pin_memory=pin) for _ in range(2)
            ]
            self._events = [torch.cuda.Event() for _ in range(2)] if pin else None
            self._buf_i = 0

    # ---- admission (schedule_policy.py) ----
    def check_fits(self, req: Req) -> None:
        """Raise ValueError if the request could never fit in the KV pool or the context."""
        self.policy.check_fits(req)

    def add_request(self, req: Req) -> None:
        """Queue a request (ValueError, nothing queued, if it has no prompt token, already
        holds memory or could never fit)."""
        if not req.origin_input_ids:
            raise ValueError(f"request {req.rid} has no input tokens")
        if req.finished or req.req_pool_idx is not None or req.kv_pages:
            raise ValueError(f"request {req.rid} was already run (finished or holding memory)")
        self.check_fits(req)
        if req.sampling_params.max_new_tokens == 0 and not wants_input_logprobs(req):
            # nothing to generate (or score): done at once
            req.check_finished()
            req.finished_time = time.perf_counter()
            self.finished_early.append(req)
        else:
            self.waiting.append(req)

    # ---- steps ----
    def _finish(self, req: Req, finished: list[Req]) -> None:
        """A finished request leaves: its computed tokens' whole pages go into the prefix cache
        (one that failed or was aborted holds nothing by now: it inserts nothing)."""
        if self.tree_cache is not None and req.error is None:
            self.tree_cache.cache_finished_req(req)
        else:
            self.batch.free_req(req)
        req.finished_time = time.perf_counter()
        finished.append(req)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        tp = getattr(self.runner, "tp_size", 1)
        greedy_ids = getattr(self.runner, "greedy_ids", None)
        lps: list[OutputLogprob | None]
        if greedy_ids is not None and tp == 1 and all(_plain_greedy(r) for r in reqs):
            # the argmax alone: a graph replay has it on the host already
            ids, lps = greedy_ids(logits), [None] * len(reqs)
        else:
            want_lp = any(r.return_logprob for r in reqs)
            plain = not any(r.sampling_params.has_penalties for r in reqs)
            ids, lps = self._sample(reqs, logits, want_lp, plain, tp)
        for req, tok, lp in zip(reqs, ids, lps, strict=True):
            if req.sampling_params.max_new_tokens == 0:  # prefilled for its prompt logprobs
                req.check_finished()
                continue
            req.output_ids.append(int(tok))
            record_output_logprob(req, lp)
            req.check_finished()

    def _sample(
        self, reqs: list[Req], logits: torch.Tensor, want_lp: bool, plain: bool, tp: int
    ) -> tuple[list[int], list[OutputLogprob | None]]:
        params = [r.sampling_params for r in reqs]
        if not plain:
            logits = apply_penalties(logits, [_penalty_inputs(r) for r in reqs])  # [B, V]
        logits = apply_logit_bias(logits, [p.logit_bias for p in params])  # [B, V]
        next_ids, _ = sample(logits, params, [r.generator for r in reqs], seeds=_step_seeds(reqs))
        if tp > 1:
            # Every rank samples the same logits; rank 0's ids make that exact (same schedule).
            tensor_model_parallel_broadcast(next_ids, src=0)
        lps: list[OutputLogprob | None] = [None] * len(reqs)
        if want_lp:  # of the distribution drawn from (srt/sampling/logprobs.py)
            lps = output_logprobs(logits, params, next_ids, top_logprobs_nums(reqs))
        return next_ids.tolist(), lps

    # ---- overlapped decode ----
    def _overlappable(self, reqs: list[Req]) -> bool:
        """Whether the next decode step of reqs may be launched before the current one's tokens
        are read (greedy or sampled without penalties or logprobs, nothing waiting to be
        admitted)."""
        plain = all(_plain(r) for r in reqs)
        return self.overlap and not self.waiting and self.chunked_req is None and plain

    def _launch_decode(
        self, reqs: list[Req], input_ids: torch.Tensor | None, prev: InFlightStep | None = None
    ) -> None:
        """Prepare and launch a decode step of reqs; its tokens are read by the next step.

        prev: the in-flight step whose tokens are input_ids (every one of its rows, in order).
        The new step's table kernel then also stores them into prev's pinned host buffer, so
        no device-to-host copy runs between the two graphs."""
        host_ids = None
        if prev is not None:
            if prev.done is not None and input_ids is prev.ids and not prev.queued:
                host_ids = prev.host
            else:
                prev.queue_copy()
        fb = self.batch.prepare_for_decode(reqs, input_ids, host_ids=host_ids)
        self._check_writes(reqs, fb)
        if prev is not None and host_ids is not None:
            assert prev.done is not None
            prev.done.record()  # after the table kernel, before this step's graph
            prev.queued = True
        logits = self.runner.forward(fb)  # [B, V]
        self.num_decode_steps += 1
        if all(_plain_greedy(r) for r in reqs):
            ids = self.runner.greedy_ids_device(logits)  # [B] int64, no wait
        else:  # sampled rows draw on the device (noise seeded per request and step)
            params, gens = [r.sampling_params for r in reqs], [r.generator for r in reqs]
            ids = sample(logits, params, gens, seeds=_step_seeds(reqs))[0]  # [B] int64
        i, self._buf_i = self._buf_i, self._buf_i ^ 1
        host = self._token_bufs[i][: len(reqs)]
        done = self._events[i] if self._events is not None else None
        self._inflight = InFlightStep(reqs, ids, host, done)

    def _try_launch(
        self, reqs: list[Req], input_ids: torch.Tensor | None, prev: InFlightStep | None = None
    ) -> bool:
        """`_launch_decode`; on an Exception the requests are restored and False returned (the
        next step then runs them step by step, isolating the failure)."""
        snaps = [ReqSnapshot.take(r) for r in reqs]
        try:
            self._launch_decode(reqs, input_ids, prev)
            return True
        except Exception:  # noqa: BLE001 - retried step by step, where it is isolated
            logger.warning("an overlapped decode launch failed; retrying step by step")
            for snap in snaps:
                snap.restore(self.batch)
            return False

    def _step_inflight(self, finished: list[Req]) -> None:
        """Launch the next decode step (if it may go), then read the in-flight one's tokens."""
        inf, self._inflight = self._inflight, None
        assert inf is not None
        keep = [i for i, r in enumerate(inf.reqs) if not r.finished and not _ends_by_length(r)]
        nxt = [inf.reqs[i] for i in keep]
        if nxt and self._overlappable(nxt):
            ids = inf.ids
            if len(keep) != len(inf.reqs):  # rows of the requests that go on
                inf.queue_copy()  # every row's token, before the next step's graph runs
                rows = upload(torch.tensor(keep, dtype=torch.int64), ids.device)
                ids = ids.index_select(0, rows)
            if self._try_launch(nxt, ids, inf):
                self.num_overlapped_steps += 1
        for req, tok in zip(inf.reqs, inf.tokens(), strict=True):
            if req.finished:  # aborted while its step ran: the token is dropped
                continue
            req.output_ids.append(tok)
            req.check_finished()
        self._after_step(finished)

    def _after_step(self, finished: list[Req]) -> None:
        """Window eviction, then the finished requests leave the running batch."""
        self.batch.evict_swa(self.running)  # window pages no later query reads (hybrid pool)
        still = []
        for req in self.running:
            if req.finished:
                self._finish(req, finished)
            else:
                still.append(req)
        self.running = still
        if not still and self._inflight is None and self.is_swa:  # idle: the mapping is current
            self.batch.token_to_kv_pool.flush_mapping_resets()

    # ---- isolation ----
    def _prefill(self, reqs: list[Req]) -> None:
        fb = self.batch.prepare_for_extend(reqs)
        self._check_writes(reqs, fb)
        logits = prefill_logits(self.runner, fb, reqs)  # [B, V] last-position logits
        self.num_prefill_steps += 1
        self._sample_and_append(reqs, logits)

    def _cache_prompts(self, reqs: list[Req]) -> None:
        """After a prefill, its requests' whole prompt pages go into the tree (as SGLang's): a
        later request matches a prompt still decoding (on the hybrid pool, before the window
        eviction frees its window pages). A failed or finished request inserts nothing here."""
        ps = self.page_size
        for r in reqs if self.tree_cache is not None else ():
            grows = r.kv_len // ps > r.cache_protected_len // ps
            if grows and not r.finished and r.error is None and r.req_pool_idx is not None:
                self.tree_cache.cache_unfinished_req(r)

    def _decode(self, reqs: list[Req]) -> None:
        fb = self.batch.prepare_for_decode(reqs)
        self._check_writes(reqs, fb)
        logits = self.runner.forward(fb)  # [B, V]
        self.num_decode_steps += 1
        self._sample_and_append(reqs, logits)

    def _check_writes(self, reqs: list[Req], fb: Any) -> None:
        """SGL_EXT_DEBUG=1: before the forward, the batch writes K/V only into its requests'
        own slots (write_check.py; a host read of the slots)."""
        if kv_write_checks_enabled():
            check_batch_writes(fb, reqs, self.running, self.tree_cache, self.page_size)

    def _isolated(self, reqs: list[Req], run: Callable[[list[Req]], None]) -> None:
        """run(reqs), one step; if it raises, undo it and retry each half, so that only the
        requests whose own step fails are failed (see the module docstring)."""
        snaps = [ReqSnapshot.take(r) for r in reqs]
        try:
            run(reqs)
            return
        except Exception as e:  # noqa: BLE001 - isolated below
            error = e
        for snap in snaps:
            snap.restore(self.batch)
        if len(reqs) == 1:
            self._fail(reqs[0], error)
            return
        half = len(reqs) // 2
        self._isolated(reqs[:half], run)
        self._isolated(reqs[half:], run)

    def _fail(self, req: Req, error: Exception) -> None:
        """Finish one request whose step failed on its own (its memory is freed here)."""
        logger.error(
            "request %s failed inside a step and was dropped alone: %s: %s",
            req.rid,
            type(error).__name__,
            error,
            exc_info=error,
        )
        self.batch.free_req(req)
        req.error = error
        message = f"{type(error).__name__}: {error}"
        req.finished_reason = {"type": "abort", "message": message, "status_code": 500}
        req.finished_time = time.perf_counter()

    def step(self) -> list[Req]:
        """One prefill or decode step. Returns the requests that finished in it.

        With the overlapped decode, a decode step returns after launching the next one: the
        requests then finish one call later than they would otherwise."""
        finished, self.finished_early = self.finished_early, []
        if self._inflight is not None:
            self._step_inflight(finished)
            return finished
        if self._chunk_due():  # chunked prefill (chunked_prefill.py)
            self._step_chunk(finished)
        elif new := self.policy.admit(self.waiting, self.running, self.chunked_req is not None):
            total = self.runner.max_total_num_tokens
            usage = 1 - self.available_kv_size() / total if total else 0.0
            self.stats.record_prefill(new, usage, len(self.running) - len(new), len(self.waiting))
            self.running.extend(new)  # from here on they hold memory (abort_all frees it)
            if self.policy.needs_chunks(new[0]):  # (admitted alone)
                self.chunked_req = new[0]
                self._step_chunk(finished)
            else:
                self._isolated(new, self._prefill)
                self._cache_prompts(new)
        elif self._chunk_alone():  # none else to step (chunked_prefill.py)
            self._step_chunk(finished)
        elif self.running:
            self._chunk_turn = True  # a chunk in progress goes on after this decode step
            reqs = [r for r in self.running if r is not self.chunked_req]
            if self._overlappable(reqs) and self._try_launch(reqs, None):
                return finished  # read back by the next call
            self._isolated(reqs, self._decode)
        elif self.waiting:
            raise RuntimeError("no running request and the first waiting one cannot be admitted")
        else:
            return finished
        self._after_step(finished)
        return finished

    def abort_all(self) -> list[Req]:
        """Drop every waiting and running request, freeing their KV memory (after an error).

        Every request is freed even if freeing one of them fails; the first such error is
        raised afterwards (the pools then hold nothing of the dropped requests but that one).
        """
        self._inflight = self.chunked_req = None  # its tokens are dropped with the requests
        dropped = list(self.waiting) + self.running + self.finished_early
        self.finished_early = []
        self.waiting.clear()
        self.running = []
        error: BaseException | None = None
        for req in dropped:
            if not req.finished:
                req.finished_reason = {"type": "abort"}
            try:
                self.batch.free_req(req)  # a no-op for requests that hold nothing
            except BaseException as e:  # noqa: BLE001 - free the rest, then re-raise
                error = error or e
        if self.is_swa:
            self.batch.token_to_kv_pool.flush_mapping_resets()
        if error is not None:
            raise error
        return dropped

    def abort(self, rid: int | str) -> Req | None:
        """Drop one waiting or running request (e.g. its client left), freeing its memory.

        Call between steps. Returns the request, or None if no unfinished request has that id.
        """
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = {"type": "abort"}
                return req
        for req in self.running:
            if req.rid == rid:
                self.batch.free_req(req)
                self.running.remove(req)
                req.finished_reason = {"type": "abort"}
                if req is self.chunked_req:
                    self.chunked_req = None
                return req
        return None

    def holds(self, req: Req) -> bool:
        """Whether a pending step still references the request (an overlapped decode step in
        flight, or the finished-at-once list): it is not done with, though its memory may be
        free already (a finished or aborted request's is)."""
        inflight = self._inflight.reqs if self._inflight is not None else ()
        return any(r is req for r in inflight) or any(r is req for r in self.finished_early)

    def available_kv_size(self) -> int:
        """KV slots free or freeable: the allocator's free slots and the prefix cache's
        evictable ones (SGLang's available size). With nothing running it is the whole pool,
        unless a page leaked or a lock was never given back."""
        free = self.runner.token_to_kv_pool_allocator.available_size()
        return free + (self.tree_cache.evictable_size() if self.tree_cache is not None else 0)

    def flush_cache(self) -> bool:
        """Drop the prefix cache (its pages back to the free list), as SGLang's flush_cache:
        only when no request waits or runs (False then, nothing changed)."""
        if self.has_work():
            return False
        if self.tree_cache is not None:
            self.tree_cache.evict(self.tree_cache.total_size())
            self.tree_cache.reset()
        return True

    def cache_hit_rate(self) -> float:
        """Share of the admitted prompt tokens taken from the prefix cache."""
        return self.stats.hit_rate()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finished_early or self._inflight)

    def run_until_idle(self, progress: Any = None) -> None:
        """Step until no request is waiting or running; `progress.update(n)` per finished."""
        while self.has_work():
            done = self.step()
            if progress is not None and done:
                progress.update(len(done))

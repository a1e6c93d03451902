"""Scheduler: continuous batching with admission control over one ModelRunner.

Each step either prefills newly admitted requests (prefill first, as in SGLang) or runs one
decode step for every running request. Requests join the running batch between decode steps and
leave it as soon as they finish, freeing their KV slots for the requests still waiting.

Admission is conservative: a request is admitted only if the KV pool can hold its whole future
(prompt + max_new_tokens, rounded up to pages) on top of what the running requests may still
need, so a decode step never runs out of memory and no request is ever retracted or lost.
With a hybrid pool (sliding-window layers in their own pool) both pools are counted: a request
needs window slots for its whole prompt during its prefill, and afterwards at most its window
(`swa_tokens_per_request`); window pages are given back after every step (`evict_swa`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from srt.distributed import tensor_model_parallel_broadcast
from srt.managers.schedule_batch import Req, ScheduleBatch, pages_needed
from srt.mem_cache.kv_memory import swa_tokens_per_request
from srt.sampling.penalties import PenaltyInputs, apply_penalties
from srt.sampling.sampler import sample


def _penalty_inputs(req: Req) -> PenaltyInputs:
    params = req.sampling_params
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= req.eos_token_ids
    return PenaltyInputs(params, req.origin_input_ids, req.output_ids, frozenset(banned))


class Scheduler:
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
        # window slots one running request may hold outside its prefill (hybrid pool only)
        self.swa_slots_per_request = (
            swa_tokens_per_request(self.batch.sliding_window_size, self.page_size)
            if self.is_swa
            else 0
        )
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.finished_early: list[Req] = []
        self.num_prefill_steps = 0
        self.num_decode_steps = 0

    # ---- admission ----
    def _slots_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size) * self.page_size

    def _swa_slots_held_max(self, req: Req) -> int:
        """Window slots the request may hold at once after its prefill."""
        return min(self._slots_for(req.target_len()), self.swa_slots_per_request)

    def _swa_slots_to_admit(self, req: Req) -> int:
        """Window slots a waiting request needs: its whole prompt while it is prefilled."""
        return max(self._slots_for(len(req.origin_input_ids)), self._swa_slots_held_max(req))

    def check_fits(self, req: Req) -> None:
        """Raise ValueError if the request could never fit in the KV pool or the context."""
        need = self._slots_for(req.target_len())
        total = self.runner.max_total_num_tokens
        if need > total:
            raise ValueError(
                f"request {req.rid} needs {need} KV slots (prompt {len(req.origin_input_ids)}"
                f" + max_new_tokens {req.sampling_params.max_new_tokens}) but the KV pool holds"
                f" {total}; raise max_total_tokens or lower max_new_tokens"
            )
        if self.is_swa:
            need = self._swa_slots_to_admit(req)
            total = self.runner.token_to_kv_pool_allocator.size_swa
            if need > total:
                raise ValueError(
                    f"request {req.rid} needs {need} sliding-window KV slots for its prompt of"
                    f" {len(req.origin_input_ids)} tokens but the window pool holds {total}"
                )

    def add_request(self, req: Req) -> None:
        self.check_fits(req)
        if req.sampling_params.max_new_tokens == 0:  # nothing to generate: done at once
            req.check_finished()
            req.finished_time = time.perf_counter()
            self.finished_early.append(req)
        else:
            self.waiting.append(req)

    def _reserved_slots(self) -> int:
        """Slots the running requests may still allocate before they finish."""
        return sum(
            self._slots_for(r.target_len()) - self._slots_for(r.kv_len) for r in self.running
        )

    def _reserved_swa_slots(self) -> int:
        """Window slots the running requests may still allocate (hybrid pool)."""
        ps = self.page_size
        return sum(
            max(0, self._swa_slots_held_max(r) - len(r.swa_pages) * ps) for r in self.running
        )

    def _admit(self) -> list[Req]:
        allocator = self.runner.token_to_kv_pool_allocator
        free = allocator.available_size() - self._reserved_slots()
        free_swa = allocator.swa_available_size() - self._reserved_swa_slots() if self.is_swa else 0
        rows = self.max_running_requests - len(self.running)
        admitted: list[Req] = []
        prefill_tokens = 0
        while self.waiting and len(admitted) < rows:
            req = self.waiting[0]
            need = self._slots_for(req.target_len())
            need_swa = self._swa_slots_to_admit(req) if self.is_swa else 0
            n = len(req.origin_input_ids)
            if (
                need > free
                or need_swa > free_swa
                or (admitted and prefill_tokens + n > self.max_prefill_tokens)
            ):
                break  # FIFO: later requests wait too, so none starves
            self.waiting.popleft()
            admitted.append(req)
            free -= need
            free_swa -= need_swa
            prefill_tokens += n
        return admitted

    # ---- steps ----
    def _finish(self, req: Req, finished: list[Req]) -> None:
        self.batch.free_req(req)
        req.finished_time = time.perf_counter()
        finished.append(req)

    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        want_lp = any(r.return_logprob for r in reqs)
        tp = getattr(self.runner, "tp_size", 1)
        plain = not any(r.sampling_params.has_penalties for r in reqs)
        greedy_ids = getattr(self.runner, "greedy_ids", None)
        lps: list[float | None]
        if (
            greedy_ids is not None
            and plain
            and tp == 1
            and not want_lp
            and all(r.sampling_params.is_greedy for r in reqs)
        ):  # the argmax alone: a graph replay has it on the host already
            ids, lps = greedy_ids(logits), [None] * len(reqs)
        else:
            ids, lps = self._sample(reqs, logits, want_lp, plain, tp)
        for req, tok, lp in zip(reqs, ids, lps, strict=True):
            req.output_ids.append(int(tok))
            if req.return_logprob:
                req.output_token_logprobs.append(float(lp))  # type: ignore[arg-type]
            req.check_finished()

    def _sample(
        self, reqs: list[Req], logits: torch.Tensor, want_lp: bool, plain: bool, tp: int
    ) -> tuple[list[int], list[float | None]]:
        if not plain:
            logits = apply_penalties(logits, [_penalty_inputs(r) for r in reqs])  # [B, V]
        next_ids, logprobs = sample(
            logits, [r.sampling_params for r in reqs], [r.generator for r in reqs], want_lp
        )
        if tp > 1:
            # Every rank samples the same logits; rank 0's ids make that exact (same schedule).
            tensor_model_parallel_broadcast(next_ids, src=0)
        lps = logprobs.tolist() if logprobs is not None else [None] * len(reqs)
        return next_ids.tolist(), lps

    def step(self) -> list[Req]:
        """One prefill or decode step. Returns the requests that finished in it."""
        finished, self.finished_early = self.finished_early, []
        new = self._admit()
        if new:
            self.running.extend(new)  # from here on they hold memory (abort_all frees it)
            fb = self.batch.prepare_for_extend(new)
            logits = self.runner.forward(fb)  # [B, V] last-position logits
            self.num_prefill_steps += 1
            self._sample_and_append(new, logits)
        elif self.running:
            reqs = self.running
            fb = self.batch.prepare_for_decode(reqs)
            logits = self.runner.forward(fb)  # [B, V]
            self.num_decode_steps += 1
            self._sample_and_append(reqs, logits)
        elif self.waiting:
            raise RuntimeError("no running request and the first waiting one cannot be admitted")
        else:
            return finished
        self.batch.evict_swa(self.running)  # window pages no later query reads (hybrid pool)
        still = []
        for req in self.running:
            if req.finished:
                self._finish(req, finished)
            else:
                still.append(req)
        self.running = still
        return finished

    def abort_all(self) -> list[Req]:
        """Drop every waiting and running request, freeing their KV memory (after an error).

        Every request is freed even if freeing one of them fails; the first such error is
        raised afterwards (the pools then hold nothing of the dropped requests but that one).
        """
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
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finished_early)

    def run_until_idle(self, progress: Any = None) -> None:
        """Step until no request is waiting or running; `progress.update(n)` per finished."""
        while self.has_work():
            done = self.step()
            if progress is not None and done:
                progress.update(len(done))

"""Chunked prefill (SGLang's `--chunked-prefill-size`): a long prompt computed over several
steps, while the running requests keep decoding between its chunks.

The scheduler admits such a request alone (`SchedulePolicy.needs_chunks`), with its whole future
reserved as any other; it sits in `running` as `chunked_req` but takes no decode step until its
prompt is done. Other requests are admitted and prefilled between its chunks; one that would be
chunked too waits for it (one chunked prompt at a time) and, FIFO, so do those behind it.

Steps alternate: one chunk of at most `chunked_prefill_size` tokens, then one decode step of the
other running requests (when there are any), then the next chunk. While others decode, a chunk
is at most `decode_chunked_prefill_size` tokens (256 by default): each of their tokens waits for
one chunk, so a long prompt costs them a bounded delay per token instead of a stall (vLLM's
long-prefill threshold, Sarathi-Serve's stall-free batching); alone, it goes on in whole chunks.

After each chunk but the last, its whole pages go into the radix cache (`cache_unfinished_req`:
insert at chunk boundaries), so a request sharing the prompt matches them at once; the last
chunk samples its first token and the request decodes with the others from then on. A chunk
that fails is undone like any step (the pages of earlier chunks, in the tree or the request's
own, stay) and fails the request alone. A request that scores its prompt (input logprobs) is
never chunked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from srt.managers.req import Req
from srt.managers.schedule_batch import ScheduleBatch
from srt.managers.scheduler_logprobs import prefill_logits


class ChunkedPrefillMixin:
    """The chunk steps of `Scheduler` (its attributes, declared here for the type checker)."""

    runner: Any
    batch: ScheduleBatch
    tree_cache: Any
    running: list[Req]
    waiting: Any
    chunked_req: Req | None
    _chunk_turn: bool
    num_prefill_steps: int
    _isolated: Callable[[list[Req], Callable[[list[Req]], None]], None]
    _check_writes: Callable[[list[Req], Any], None]
    _cache_prompts: Callable[[list[Req]], None]
    _sample_and_append: Callable[[list[Req], Any], None]
    policy: Any

    def _chunk_alone(self) -> bool:
        """Whether the chunked request is the only one running."""
        req = self.chunked_req
        return req is not None and all(r is req for r in self.running)

    def _chunk_due(self) -> bool:
        """Whether this step is the chunked request's: its turn, or it runs alone and none waits
        (a waiting request is tried first: admitted between chunks)."""
        if self.chunked_req is None:
            return False
        return self._chunk_turn or (self._chunk_alone() and not self.waiting)

    def _step_chunk(self, finished: list[Req]) -> None:
        """One chunk of `chunked_req` (isolated like any step); decodes go next."""
        req = self.chunked_req
        assert req is not None
        self._chunk_turn = False
        self._isolated([req], self._prefill_chunk)
        if req.finished or req.kv_len == len(req.origin_input_ids):
            self.chunked_req = None  # failed alone, or prompt done: it decodes from now on
            self._cache_prompts([req])

    def _prefill_chunk(self, reqs: list[Req]) -> None:
        (req,) = reqs
        rest = len(req.origin_input_ids) - req.kv_len
        decoding = any(r is not req for r in self.running)
        policy = self.policy
        n = min(policy.decode_chunk_size if decoding else policy.chunked_prefill_size, rest)
        fb = self.batch.prepare_for_extend([req], [n])
        self._check_writes([req], fb)
        if n < rest:  # a middle chunk: no token yet; its whole pages into the prefix cache
            self.runner.forward(fb)
            self.num_prefill_steps += 1
            if self.tree_cache is not None:
                self.tree_cache.cache_unfinished_req(req)
            return
        logits = prefill_logits(self.runner, fb, [req])  # [1, V]
        self.num_prefill_steps += 1
        self._sample_and_append([req], logits)

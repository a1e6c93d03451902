"""ReqSnapshot: what one step may change in a request, so a failed step can be undone.

The scheduler takes a snapshot of every request of a step before running it. When the step
raises, each request is restored (KV slots taken by the step given back, tokens, every logprob
list, finish reason, draw count and generator state as before) and the step is retried without the
request that fails (`Scheduler._isolated`): the others then compute exactly what they would
have computed had the failing request never been there.

Every `Req` field a step writes must be restored here: a retried step would otherwise append
a second entry (or keep one of the failed step's) beside the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from srt.managers.schedule_batch import Req, ScheduleBatch


@dataclass(frozen=True)
class ReqSnapshot:
    """One request's state before a step.

    Attributes
    ----------
    req : the request.
    held : whether it held a req_to_token row (False: the step is its prefill).
    kv_len : its cached tokens.
    num_output, num_logprobs, num_top : lengths of output_ids, output_token_logprobs and
        output_top_logprobs (a sampled token appends to each).
    input_logprobs, input_top_logprobs : the prompt's logprob lists (a prefill that scores the
        prompt replaces them) and their lengths.
    finished_reason : its finish reason (None while it runs).
    draws : its sampled-step count (the next noise seed).
    generator_state : its generator's state (sampled requests only; None for greedy ones).
    """

    req: Req
    held: bool
    kv_len: int
    num_output: int
    num_logprobs: int
    num_top: int
    input_logprobs: tuple[list[float | None], int]
    input_top_logprobs: tuple[list[list[tuple[float, int]] | None], int]
    finished_reason: dict[str, Any] | None
    draws: int
    generator_state: torch.Tensor | None

    @classmethod
    def take(cls, req: Req) -> ReqSnapshot:
        gen = req.generator
        return cls(
            req=req,
            held=req.req_pool_idx is not None,
            kv_len=req.kv_len,
            num_output=len(req.output_ids),
            num_logprobs=len(req.output_token_logprobs),
            num_top=len(req.output_top_logprobs),
            input_logprobs=(req.input_token_logprobs, len(req.input_token_logprobs)),
            input_top_logprobs=(req.input_top_logprobs, len(req.input_top_logprobs)),
            finished_reason=req.finished_reason,
            draws=req.draws,
            # a host-side copy of the seed and offset (no device sync on CUDA)
            generator_state=None if gen is None else gen.get_state(),
        )

    def restore(self, batch: ScheduleBatch) -> None:
        """Undo what a failed step did to the request, giving back the KV memory it took."""
        req = self.req
        if self.held:
            batch.truncate_kv(req, self.kv_len)
        else:  # its prefill failed: its row and its own slots came from that step (a cached
            batch.undo_prefill(req)  # prefix matched at admission stays, locked)
        del req.output_ids[self.num_output :]
        del req.output_token_logprobs[self.num_logprobs :]
        del req.output_top_logprobs[self.num_top :]
        req.input_token_logprobs, n = self.input_logprobs
        del req.input_token_logprobs[n:]
        req.input_top_logprobs, n = self.input_top_logprobs
        del req.input_top_logprobs[n:]
        req.finished_reason = self.finished_reason
        req.draws = self.draws
        if self.generator_state is not None:
            assert req.generator is not None
            req.generator.set_state(self.generator_state)

"""The scheduler's prefix-cache statistics and its prefill log line (SGLang's
`Prefill batch. #new-seq ... #cached-token ...`, with the cache's hit rate so far)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from srt.managers.req import Req

logger = logging.getLogger("srt.managers.scheduler")


@dataclass
class PrefixCacheStats:
    """Prompt tokens admitted so far, and how many of them came from the prefix cache."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def hit_rate(self) -> float:
        """Share of the admitted prompt tokens taken from the prefix cache."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def record_prefill(
        self, new: list[Req], token_usage: float, num_running: int, num_waiting: int
    ) -> None:
        """Count an admitted batch; log SGLang's prefill line (INFO)."""
        prompt = sum(len(r.origin_input_ids) for r in new)
        cached = sum(r.cached_tokens for r in new)
        self.num_prompt_tokens += prompt
        self.num_cached_tokens += cached
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate:"
            " %.1f%%, token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(new),
            prompt - cached,
            cached,
            100 * self.hit_rate(),
            token_usage,
            num_running,
            num_waiting,
        )

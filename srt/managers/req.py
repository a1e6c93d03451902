"""Req: one generation request and its progress (SGLang's `Req`, kept in schedule_batch.py
there; `srt.managers.schedule_batch` re-exports it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from srt.sampling.sampling_params import SamplingParams


@dataclass
class Req:
    """One generation request and its progress.

    `kv_len` counts the tokens whose K/V are in the cache; they sit at
    `req_to_token[req_pool_idx, :kv_len]`. After the prefill, every decode step feeds
    `output_ids[-1]` at position `kv_len`. `kv_pages` is the host copy of the KV pages the
    request holds, in token order (token i is in slot kv_pages[i // page_size] * page_size
    + i % page_size; for page_size 1 these are the slots): freeing and the next slot are known
    without reading the device. With the radix cache, the pages of the first
    `cache_protected_len` tokens are the tree's (the path to `last_node`, which the request
    keeps locked): the request never writes or frees them; the rest are its own. With a
    hybrid pool, `swa_pages` are the window pages the request still holds: token pages
    swa_page_start, swa_page_start + 1, ... (token i, if still in the window, is in window
    slot swa_pages[i // page_size - swa_page_start] * page_size + i % page_size).
    """

    rid: int | str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    generator: torch.Generator | None = None
    draws: int = 0  # sampled steps so far (the next one's noise seed: sampler.step_seed)
    eos_token_ids: frozenset[int] = frozenset()
    max_total_len: int = 0  # prompt + generated tokens allowed (context limit)
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    # ---- logprobs beyond the sampled tokens' (SGLang's; only with return_logprob) ----
    top_logprobs_num: int = 0  # top entries per scored position
    # first prompt position with an input logprob (len(origin_input_ids): none; SGLang's -1)
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False  # the outputs' tuples carry each token's text
    # prompt tokens logprob_start_len .. end: None for the first (as SGLang), then floats
    input_token_logprobs: list[float | None] = field(default_factory=list)
    # their top lists ((logprob, id) pairs; None for the first), when top_logprobs_num > 0
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    # each output token's top list, when top_logprobs_num > 0
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    kv_pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    swa_page_start: int = 0
    # ---- prefix cache (srt/mem_cache/radix_cache.py) ----
    extra_key: str | None = None  # requests with different extra keys never share a prefix
    last_node: Any = None  # the radix-tree node whose path the request holds locked
    cache_protected_len: int = 0  # leading tokens held in the tree's pages (whole pages)
    cached_tokens: int = 0  # prompt tokens taken from the cache at admission
    finished_reason: dict[str, Any] | None = None
    # Token ids -> text, for stop strings (None: stop strings are not checked).
    decode: Callable[[list[int]], str] | None = None
    created_time: float = 0.0  # time.perf_counter() when the request was made
    finished_time: float = 0.0  # when the scheduler finished it (0.0 while running)
    meta: dict[str, Any] = field(default_factory=dict)  # extra meta_info (e.g. truncation)
    # The exception that failed this request alone inside a step (finish reason "abort").
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def target_len(self) -> int:
        """Most tokens this request can ever hold in the KV cache."""
        total = len(self.origin_input_ids) + self.sampling_params.max_new_tokens
        if self.max_total_len:
            total = min(total, self.max_total_len)
        # The last sampled token is never fed back, so its K/V is never stored.
        return max(len(self.origin_input_ids), total - 1)

    def check_finished(self) -> None:
        """Set finished_reason after a token was appended to output_ids.

        Stop tokens, EOS and stop strings count only once min_new_tokens were generated.
        """
        params = self.sampling_params
        if not self.output_ids:
            if params.max_new_tokens == 0:
                self.finished_reason = {"type": "length", "length": 0}
            return
        last = self.output_ids[-1]
        if len(self.output_ids) >= params.min_new_tokens:
            if last in params.stop_token_ids:
                self.finished_reason = {"type": "stop", "matched": last}
            elif not params.ignore_eos and last in self.eos_token_ids:
                self.finished_reason = {"type": "stop", "matched": last}
            elif params.stop and self.decode is not None:
                matched = self._matched_stop_str()
                if matched is not None:
                    self.finished_reason = {"type": "stop", "matched": matched}
            if self.finished_reason is not None:
                return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = {"type": "length", "length": len(self.output_ids)}
        elif self.max_total_len and len(self.origin_input_ids) + len(self.output_ids) >= (
            self.max_total_len
        ):
            self.finished_reason = {"type": "length", "length": len(self.output_ids)}

    def _matched_stop_str(self) -> str | None:
        """The first stop string in the text of the last tokens (enough to hold any of them)."""
        stops = self.sampling_params.stop
        tail = self.output_ids[-(max(len(s) for s in stops) + 8) :]
        text = self.decode(tail)  # type: ignore[misc]
        return next((s for s in stops if s in text), None)

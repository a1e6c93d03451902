"""Req and ScheduleBatch: request state and the host-side building of ForwardBatches.

A `Req` owns one row of the ReqToTokenPool and the KV slots listed in that row. `ScheduleBatch`
turns a list of requests into the `ForwardBatch` of an EXTEND (prefill) or DECODE step and
allocates the KV slots those steps write; `free_req` gives everything back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    compute_extend_metadata,
)
from srt.sampling.sampling_params import SamplingParams


@dataclass
class Req:
    """One generation request and its progress.

    `kv_len` counts the tokens whose K/V are in the cache; they sit at
    `req_to_token[req_pool_idx, :kv_len]`. After the prefill, every decode step feeds
    `output_ids[-1]` at position `kv_len`.
    """

    rid: int | str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] = frozenset()
    max_total_len: int = 0  # prompt + generated tokens allowed (context limit)
    output_ids: list[int] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    finished_reason: dict[str, Any] | None = None
    # Token ids -> text, for stop strings (None: stop strings are not checked).
    decode: Callable[[list[int]], str] | None = None
    created_time: float = 0.0  # time.perf_counter() when the request was made
    finished_time: float = 0.0  # when the scheduler finished it (0.0 while running)
    meta: dict[str, Any] = field(default_factory=dict)  # extra meta_info (e.g. truncation)

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


def pages_needed(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


class ScheduleBatch:
    """Builds ForwardBatches for a list of requests and manages their KV slots.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool (alloc/free rows, `.req_to_token` int32 [rows, ctx]).
    allocator : TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator
        (`alloc(n)` -> int tensor of n slots or None, page-aligned for the paged one; `free`).
    token_to_kv_pool, attn_backend : handed to every ForwardBatch.
    page_size : tokens per KV page.
    enable_fused_rope_kv : copied into every ForwardBatch.
    """

    def __init__(
        self,
        req_to_token_pool: Any,
        allocator: Any,
        token_to_kv_pool: Any,
        attn_backend: Any,
        page_size: int,
        device: torch.device,
        enable_fused_rope_kv: bool,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.token_to_kv_pool = token_to_kv_pool
        self.attn_backend = attn_backend
        self.page_size = page_size
        self.device = torch.device(device)
        self.enable_fused_rope_kv = enable_fused_rope_kv

    @classmethod
    def from_runner(cls, runner: Any, enable_fused_rope_kv: bool | None = None) -> ScheduleBatch:
        """Bound to a ModelRunner's pools and backend (fusion: the runner's setting by default)."""
        fused = runner.server_args.enable_fused_rope_kv
        return cls(
            runner.req_to_token_pool,
            runner.token_to_kv_pool_allocator,
            runner.token_to_kv_pool,
            runner.attn_backend,
            runner.page_size,
            runner.device,
            fused if enable_fused_rope_kv is None else enable_fused_rope_kv,
        )

    # ---- memory ----
    def _alloc_slots(self, num_tokens: int) -> torch.Tensor:
        slots = self.allocator.alloc(num_tokens)
        if slots is None:
            # Admission control reserves every request's memory up front: this is a bug.
            raise RuntimeError(f"KV pool out of memory allocating {num_tokens} slots")
        return slots

    def free_req(self, req: Req) -> None:
        """Return the request's KV slots (whole pages) and its req_to_token row."""
        if req.req_pool_idx is None:
            return
        if req.kv_len > 0:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]  # int32 [ctx]
            # A paged allocator frees the pages these slots lie in (incl. the unused tail).
            self.allocator.free(row[: req.kv_len].to(torch.int64))
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0

    # ---- forward batches ----
    def _forward_batch(self, mode: ForwardMode, **kw: Any) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=mode,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend,
            enable_fused_rope_kv=self.enable_fused_rope_kv,
            **kw,
        )

    def prepare_for_extend(self, reqs: list[Req]) -> ForwardBatch:
        """Give each request a req_to_token row and KV slots for its prompt; the prefill batch."""
        rows = self.req_to_token_pool.alloc(len(reqs))
        if rows is None:
            raise RuntimeError(f"ReqToTokenPool has no room for {len(reqs)} requests")
        ps = self.page_size
        lens = [len(r.origin_input_ids) for r in reqs]
        slots = self._alloc_slots(sum(pages_needed(n, ps) * ps for n in lens))
        locs, offset = [], 0
        for req, row, n in zip(reqs, rows, lens, strict=True):
            req.req_pool_idx = int(row)
            loc = slots[offset : offset + n]  # [n] this request's slots (page-aligned start)
            offset += pages_needed(n, ps) * ps
            self.req_to_token_pool.req_to_token[req.req_pool_idx, :n] = loc.to(torch.int32)
            req.kv_len = n
            locs.append(loc)
        meta = compute_extend_metadata([0] * len(reqs), lens, self.device)
        input_ids = [t for r in reqs for t in r.origin_input_ids]
        return self._forward_batch(
            ForwardMode.EXTEND,
            batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=self.device),
            out_cache_loc=torch.cat(locs).to(torch.int64),
            **meta,
        )

    def prepare_for_decode(self, reqs: list[Req]) -> ForwardBatch:
        """One new token per request: allocate its slot and build the decode batch."""
        dev = self.device
        ps = self.page_size
        rows_cpu = [r.req_pool_idx for r in reqs]
        kv_cpu = [r.kv_len for r in reqs]  # position of the new token
        rows = torch.tensor(rows_cpu, dtype=torch.int64, device=dev)  # [B]
        pos = torch.tensor(kv_cpu, dtype=torch.int64, device=dev)  # [B]
        need_page = [i for i, n in enumerate(kv_cpu) if n % ps == 0]
        req_to_token = self.req_to_token_pool.req_to_token
        if ps == 1:
            out_cache_loc = self._alloc_slots(len(reqs)).to(torch.int64)  # [B]
        else:
            # The slot after the previous token, unless that token ended its page.
            last_loc = req_to_token[rows, pos - 1].to(torch.int64)  # [B]
            out_cache_loc = last_loc + 1
            if need_page:
                new = self._alloc_slots(len(need_page) * ps).to(torch.int64)
                new = new.view(len(need_page), ps)[:, 0]  # [P] first slot of each new page
                idx = torch.tensor(need_page, dtype=torch.int64, device=dev)
                out_cache_loc[idx] = new
        req_to_token[rows, pos] = out_cache_loc.to(torch.int32)
        for r in reqs:
            r.kv_len += 1
        seq_lens_cpu = torch.tensor(kv_cpu, dtype=torch.int64) + 1  # [B]
        input_ids = [r.output_ids[-1] for r in reqs]
        return self._forward_batch(
            ForwardMode.DECODE,
            batch_size=len(reqs),
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            req_pool_indices=rows,
            seq_lens=pos + 1,
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            out_cache_loc=out_cache_loc,
            positions=pos,
        )

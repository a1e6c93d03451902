"""ScheduleBatch: the host-side building of ForwardBatches. A `Req` (req.py) owns one row of the
ReqToTokenPool and the KV slots listed in that row (and, on the host, in `Req.kv_pages`).
`ScheduleBatch` turns a list of requests into the `ForwardBatch` of an EXTEND (prefill) or
DECODE step and allocates the KV slots those steps write through the allocator's
`alloc_extend` / `alloc_decode`; `free_req` gives everything back. A failed `prepare_for_extend`
gives back what it took; after any later failure, `free_req` on every request that holds memory
restores both pools.

With the radix cache (`tree_cache`), a request admitted with a cached prefix arrives here with
the tree's pages of that prefix in `kv_pages` (`cache_protected_len` tokens, whole pages, their
path locked): `prepare_for_extend` computes only the rest, in freshly allocated pages, and
points its req_to_token row at both; nothing here writes or frees a page of the tree.

With a hybrid pool (`SWATokenToKVPoolAllocator` over an `SWAKVPool`) every new token also gets
a window slot (written to `req_to_swa_token`); `evict_swa` gives back the window pages of tokens
that no later query of their request can see (page-aware), after every forward. A cached prefix
brings the tree's window pages of its last W tokens (`Req.swa_pages` below
`cache_protected_len`): read, never written or freed here (nor its full pages).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from srt.managers.req import Req
from srt.managers.shared_prefix import SharedPrefixFinder
from srt.mem_cache.decode_writes import StepExtras, write_decode_rows
from srt.mem_cache.host_copy import upload
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, compute_extend_metadata


def pages_needed(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


class ScheduleBatch:
    """Builds ForwardBatches for a list of requests and manages their KV slots.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool (alloc/free rows, `.req_to_token` int32 [rows, ctx]).
    allocator : TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator
        (`alloc_extend` / `alloc_decode` -> host int64 slots or None; `free`), or an
        SWATokenToKVPoolAllocator (hybrid pool: the same calls with `swa_last_loc`, returning
        SWASlots; `free_swa`).
    token_to_kv_pool, attn_backend : handed to every ForwardBatch.
    page_size : tokens per KV page.
    enable_fused_rope_kv : copied into every ForwardBatch.

    Attributes
    ----------
    tree_cache : RadixCache or None (set by the scheduler): the prefix cache whose locks
        `free_req` gives back.
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
        self.is_swa = hasattr(allocator, "swa_available_size")
        # window-left W of the hybrid pool: a query at position p reads tokens p - W .. p
        self.sliding_window_size = int(getattr(token_to_kv_pool, "sliding_window_size", 0) or 0)
        # (B, block rows) -> where a decode block of B requests is written on the device (the
        # decode graph's static inputs) or None: the upload's own memory (set by from_runner)
        self.decode_dest: Callable[[int, int], torch.Tensor | None] | None = None
        self.tree_cache: Any = None
        self.shared_prefixes: SharedPrefixFinder | None = None  # decode groups (cascade), or off

    @classmethod
    def from_runner(cls, runner: Any, enable_fused_rope_kv: bool | None = None) -> ScheduleBatch:
        """Bound to a ModelRunner's pools and backend (fusion: the runner's setting by default)
        and to its decode graphs' static inputs (`decode_dest`)."""
        fused = runner.server_args.enable_fused_rope_kv
        batch = cls(
            runner.req_to_token_pool,
            runner.token_to_kv_pool_allocator,
            runner.token_to_kv_pool,
            runner.attn_backend,
            runner.page_size,
            runner.device,
            fused if enable_fused_rope_kv is None else enable_fused_rope_kv,
        )
        batch.decode_dest = getattr(runner, "decode_static_inputs", None)
        if runner.cascade_attn:  # groups only for a backend that reads them
            batch.shared_prefixes = SharedPrefixFinder()
        return batch

    def free_req(self, req: Req) -> None:
        """Return the request's KV pages and its req_to_token row (a no-op if it holds none),
        and unlock its cached prefix; the prefix's pages stay the tree's. Nothing is inserted
        into the tree (a failed or aborted request's tokens are never cached: see
        `RadixCache.cache_finished_req` for a finished one).

        The pages are known on the host (`req.kv_pages`), so this never reads the device.
        """
        own_from = req.cache_protected_len // self.page_size
        swa_pages, swa_full = self._own_swa_pages(req, len(req.swa_pages))
        node, req.last_node, req.cache_protected_len = req.last_node, None, 0
        pages, req.kv_pages, req.kv_len = req.kv_pages[own_from:], [], 0
        req.swa_pages, req.swa_page_start = [], 0
        row, req.req_pool_idx = req.req_pool_idx, None
        try:
            if swa_pages:
                self._free_swa_pages(swa_pages, swa_full)
            if pages:
                first_slots = torch.tensor(pages, dtype=torch.int64) * self.page_size  # [P]
                self.allocator.free(first_slots)
        finally:
            if node is not None:
                self.tree_cache.dec_lock_ref(node)
            if row is not None:
                self.req_to_token_pool.free(row)

    def undo_prefill(self, req: Req) -> None:
        """Give back what a failed prefill took (its req_to_token row and its own pages); a
        prefix matched at admission stays (the tree's pages, the lock), so a retry computes
        only the rest again."""
        keep = req.cache_protected_len
        if keep == 0:
            self.free_req(req)
            return
        self.truncate_kv(req, keep)
        row, req.req_pool_idx = req.req_pool_idx, None
        if row is not None:
            self.req_to_token_pool.free(row)

    def truncate_kv(self, req: Req, kv_len: int) -> None:
        """Give back the KV pages of the request's tokens from `kv_len` on (those a failed step
        took); 0 frees everything, as free_req. Host data only, no device read. The tokens of
        a cached prefix (`cache_protected_len`) are the tree's: never given back here."""
        if kv_len < req.cache_protected_len:
            raise ValueError(
                f"request {req.rid}: cannot cut its KV to {kv_len} tokens inside its cached"
                f" prefix of {req.cache_protected_len}"
            )
        if kv_len <= 0:
            self.free_req(req)
            return
        if req.kv_len <= kv_len:
            return
        ps = self.page_size
        keep = pages_needed(kv_len, ps)
        pages, req.kv_pages = req.kv_pages[keep:], req.kv_pages[:keep]
        req.kv_len = kv_len
        # window pages cover token pages swa_page_start, swa_page_start + 1, ...
        n_swa = max(0, keep - req.swa_page_start)
        swa_pages, req.swa_pages = req.swa_pages[n_swa:], req.swa_pages[:n_swa]
        if swa_pages:
            self._free_swa_pages(swa_pages, pages[: len(swa_pages)])
        if pages:
            self.allocator.free(torch.tensor(pages, dtype=torch.int64) * ps)

    def _own_swa_pages(self, req: Req, n: int) -> tuple[list[int], list[int]]:
        """Its own of `swa_pages[:n]` and their full pages (those below its prefix: the tree's)."""
        start = req.swa_page_start
        skip = min(n, max(0, req.cache_protected_len // self.page_size - start))
        return req.swa_pages[skip:n], req.kv_pages[start + skip : start + n]

    def _free_swa_pages(self, swa_pages: list[int], full_pages: list[int]) -> None:
        """Free window pages; the tokens of the matching full pages lose their window slots."""
        ps = self.page_size
        swa_first = torch.tensor(swa_pages, dtype=torch.int64) * ps  # [P]
        offs = torch.arange(ps, dtype=torch.int64)
        full = (torch.tensor(full_pages, dtype=torch.int64)[:, None] * ps + offs).reshape(-1)
        self.allocator.free_swa(swa_first, full)

    def evict_swa(self, reqs: list[Req]) -> None:
        """Free the window pages of tokens that left every later query's window.

        A request with kv_len cached tokens next feeds position kv_len, which reads tokens
        kv_len - W .. kv_len: pages wholly before kv_len - W are freed (host data only, plus
        one device write of the mapping). A no-op without a hybrid pool.
        """
        if not self.is_swa:
            return
        W, ps = self.sliding_window_size, self.page_size
        plan = []  # (request, first page kept)
        swa_free: list[int] = []
        full_pages: list[int] = []
        for r in reqs:
            if r.req_pool_idx is None or not r.swa_pages:
                continue
            keep = max(0, r.kv_len - W) // ps  # token page of the oldest key still read
            n = keep - r.swa_page_start
            if n > 0:
                own, full = self._own_swa_pages(r, n)  # (the tree's are only dropped)
                swa_free += own
                full_pages += full
                plan.append((r, keep))
        if not plan:
            return
        if swa_free:
            self._free_swa_pages(swa_free, full_pages)
        for r, keep in plan:
            del r.swa_pages[: keep - r.swa_page_start]
            r.swa_page_start = keep

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # queued without a host wait (the overlapped decode prepares while a step runs)
        return upload(host, self.device)

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

    def prepare_for_extend(
        self, reqs: list[Req], extend_lens: list[int] | None = None
    ) -> ForwardBatch:
        """KV slots for the prompt tokens each request computes now; the EXTEND batch.

        A request's first step gives it a req_to_token row and computes its prompt past its
        cached prefix (the tree's pages already in `kv_pages`, `kv_len == cache_protected_len`);
        a request whose earlier chunks were computed (chunked prefill) keeps its row and goes on
        from `kv_len`. `extend_lens`: tokens each computes in this step (default: the rest of
        its prompt).

        On any failure (no free row, no free KV pages, an interrupt) every row and page taken
        here is given back before the exception propagates (a prefix, earlier chunks stay).
        """
        ps = self.page_size
        lens = [len(r.origin_input_ids) - r.kv_len for r in reqs]
        lens = lens if extend_lens is None else list(extend_lens)
        if len(lens) != len(reqs):
            raise ValueError(f"extend_lens has {len(lens)} entries for {len(reqs)} requests")
        new = [r for r in reqs if r.req_pool_idx is None]
        for r, n in zip(reqs, lens, strict=True):
            p = r.cache_protected_len
            if r.req_pool_idx is None and (r.kv_len != p or len(r.kv_pages) != p // ps):
                raise ValueError(f"request {r.rid} already holds memory (prefilled twice?)")
            if r.req_pool_idx is None and p % ps:
                raise ValueError(
                    f"request {r.rid}: a cached prefix of {p} tokens must be whole pages of {ps}"
                )
            if not 1 <= n <= len(r.origin_input_ids) - r.kv_len:
                raise ValueError(
                    f"request {r.rid} already holds memory (prefilled twice?): {n} tokens past"
                    f" {r.kv_len} of its prompt of {len(r.origin_input_ids)}"
                )
        rows = self.req_to_token_pool.alloc(len(new))
        if rows is None:
            raise RuntimeError(f"ReqToTokenPool has no room for {len(new)} requests")
        for req, row in zip(new, rows, strict=True):
            req.req_pool_idx = row  # from here on undo_prefill gives the row back
        before = [r.kv_len for r in reqs]
        try:
            return self._build_extend(reqs, lens, {id(r) for r in new})
        except BaseException:
            for req, kv_len in zip(reqs, before, strict=True):
                if any(req is r for r in new):
                    self.undo_prefill(req)
                else:
                    self.truncate_kv(req, kv_len)
            raise

    def _page_slots(self, pages: list[int], first: int, end: int) -> torch.Tensor:
        """int64 [end - first] host slots of tokens first .. end - 1 held in `pages`."""
        ps = self.page_size
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)[first:end]

    def _build_extend(self, reqs: list[Req], lens: list[int], new: set[int]) -> ForwardBatch:
        ps = self.page_size
        prefix = [r.kv_len for r in reqs]  # a cached prefix or earlier chunks
        meta = compute_extend_metadata(prefix, lens, self.device)
        n_tok = sum(lens)
        prefix_t = torch.tensor(prefix, dtype=torch.int64)  # [B]
        end_t = prefix_t + torch.tensor(lens, dtype=torch.int64)  # [B]
        # the last computed token's slot (a cached prefix's page is full), or -1
        last = torch.tensor(
            [
                r.kv_pages[(p - 1) // ps] * ps + (p - 1) % ps if p else -1
                for r, p in zip(reqs, prefix, strict=True)
            ]
        )
        swa_slots = None
        if self.is_swa:  # the window slot of the last computed token (the tree's or its own)
            swa_last = torch.tensor(
                [self._swa_slot(r, p - 1) if p else -1 for r, p in zip(reqs, prefix, strict=True)]
            )
            new_pages = (end_t + ps - 1) // ps - (prefix_t + ps - 1) // ps  # [B]
            self._make_swa_room(int(new_pages.sum()) * ps)
            got = self.allocator.alloc_extend(prefix_t, end_t, last, n_tok, swa_last_loc=swa_last)
            slots, swa_slots = (None, None) if got is None else (got.full, got.swa)
        else:
            slots = self.allocator.alloc_extend(prefix_t, end_t, last, n_tok)
        # slots: host int64 [T], request order; a partly filled last page is filled first
        if slots is None:
            # Admission control reserves every request's memory up front: this is a bug.
            raise RuntimeError(f"KV pool out of memory allocating {n_tok} slots")
        offset = 0
        for req, n, p in zip(reqs, lens, prefix, strict=True):
            first_new = offset + (-p) % ps  # the first token of a fresh page
            req.kv_pages += (slots[first_new : offset + n : ps] // ps).tolist()
            if swa_slots is not None:  # after its prefix's (the tree's) or earlier chunks'
                req.swa_pages += (swa_slots[first_new : offset + n : ps] // ps).tolist()
            req.kv_len += n
            offset += n
        rows_t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)  # [B]
        out_cache_loc = self._to_device(slots)  # [T]
        r2t = self.req_to_token_pool
        # req_to_token entries: a new request's whole prompt so far (its cached prefix too), a
        # continuing one's new tokens: [3, N] (row, position, slot) in one upload
        firsts = [0 if id(r) in new else p for r, p in zip(reqs, prefix, strict=True)]
        ends = end_t.tolist()
        every = torch.cat(
            [self._page_slots(r.kv_pages, f, e) for r, f, e in zip(reqs, firsts, ends, strict=True)]
        )
        spans = list(zip(firsts, ends, strict=True))
        pos = torch.cat([torch.arange(f, e, dtype=torch.int64) for f, e in spans])
        counts = torch.tensor(ends) - torch.tensor(firsts)
        row_of = torch.repeat_interleave(rows_t, counts, output_size=len(every))
        table = self._to_device(torch.stack((row_of, pos, every)))  # [3, N]
        r2t.req_to_token[table[0], table[1]] = table[2].to(torch.int32)
        if swa_slots is not None:  # window slots from the first one a query still reads
            self._write_swa_rows(reqs, firsts, ends)
        ids = [
            t for r, p, e in zip(reqs, prefix, ends, strict=True) for t in r.origin_input_ids[p:e]
        ]
        return self._forward_batch(
            ForwardMode.EXTEND,
            batch_size=len(reqs),
            input_ids=self._to_device(torch.tensor(ids, dtype=torch.int64)),
            req_pool_indices=self._to_device(rows_t),
            out_cache_loc=out_cache_loc,
            **meta,
        )

    def _write_swa_rows(self, reqs: list[Req], firsts: list[int], ends: list[int]) -> None:
        """req_to_swa_token of tokens max(first, the request's first window page) .. end - 1
        (a new request's cached prefix: the tree's window slots of its last W tokens)."""
        ps, cols = self.page_size, []
        for r, f, e in zip(reqs, firsts, ends, strict=True):
            s0 = r.swa_page_start * ps
            f = max(f, s0)
            pos = torch.arange(f, e, dtype=torch.int64)
            row = torch.full_like(pos, r.req_pool_idx or 0)
            cols.append(torch.stack((row, pos, self._page_slots(r.swa_pages, f - s0, e - s0))))
        table = self._to_device(torch.cat(cols, dim=1))  # [3, N] (row, position, slot)
        self.req_to_token_pool.req_to_swa_token[table[0], table[1]] = table[2].to(torch.int32)

    def _make_swa_room(self, num_slots: int) -> None:
        """Tombstone the tree's unlocked window pages (counted free at admission) if needed."""
        short = num_slots - self.allocator.swa_available_size()
        if short > 0 and self.tree_cache is not None:
            self.tree_cache.evict_swa(short)

    def _swa_slot(self, req: Req, token: int) -> int:
        """Window slot of token `token` of the request (host data; it must be in the window)."""
        ps = self.page_size
        return req.swa_pages[token // ps - req.swa_page_start] * ps + token % ps

    def prepare_for_decode(
        self,
        reqs: list[Req],
        input_ids: torch.Tensor | None = None,
        *,
        host_ids: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """One new token per request: allocate its slot and build the decode batch.

        The slots come from `alloc_decode` on host data (each request's pages), so no device
        read happens here; if the pool is full, nothing changes and RuntimeError is raised.
        `input_ids` (int64 [B] on the device): the tokens to feed, in place of each request's
        `output_ids[-1]` (the overlapped decode: the previous step's greedy ids, not yet read
        back); copied on the stream, no wait. `host_ids` (int64 [B] pinned host memory, with
        input_ids): also receives input_ids, from the same kernel.

        When `decode_dest` gives the decode graph's static inputs for B requests, the block is
        written there (the replay then copies nothing).
        """
        if input_ids is not None and (
            input_ids.shape != (len(reqs),)
            or input_ids.dtype != torch.int64
            or input_ids.device != self.device
        ):
            raise ValueError(
                f"input_ids must be int64 [{len(reqs)}] on {self.device}, got "
                f"{input_ids.dtype} {tuple(input_ids.shape)} on {input_ids.device}"
            )
        idle = [r for r in reqs if r.req_pool_idx is None or r.kv_len < 1]
        if idle:
            raise ValueError(f"request {idle[0].rid} was not prefilled (or was already freed)")
        ps = self.page_size
        # int64 [5 or 6, B] host block: input id, request row, sequence length with the new
        # token, previous token's slot (from the host page list), new token's position (and the
        # previous token's window slot); it travels to the device in one copy and, once the new
        # slots replace the previous ones, is the batch's decode inputs (decode_inputs).
        block = [
            [r.output_ids[-1] if input_ids is None else 0 for r in reqs],
            [r.req_pool_idx for r in reqs],
            [r.kv_len + 1 for r in reqs],
            [r.kv_pages[(r.kv_len - 1) // ps] * ps + (r.kv_len - 1) % ps for r in reqs],
            [r.kv_len for r in reqs],
        ]
        if self.is_swa:
            block.append([self._swa_slot(r, r.kv_len - 1) for r in reqs])
        host = torch.tensor(block, dtype=torch.int64)
        seq_lens_cpu = host[2].clone()  # [B]
        swa_slots = None
        if self.is_swa:
            self._make_swa_room(sum(r.kv_len % ps == 0 for r in reqs) * ps)
        # the new pages' scrub is listed, not launched: it rides on the block's upload below
        with self.allocator.deferred_scrub() as scrubs:
            if self.is_swa:  # the mapping of the new slots: written with the request tables
                got = self.allocator.alloc_decode(
                    seq_lens_cpu, host[3], swa_last_loc=host[5], set_mapping=False
                )
                slots, swa_slots = (None, None) if got is None else (got.full, got.swa)
            else:
                slots = self.allocator.alloc_decode(seq_lens_cpu, host[3])  # host int64 [B]
        if slots is None:
            raise RuntimeError(f"KV pool out of memory allocating {len(reqs)} decode slots")
        for i, (r, slot) in enumerate(zip(reqs, slots.tolist(), strict=True)):
            if r.kv_len % ps == 0:
                r.kv_pages.append(slot // ps)
                if swa_slots is not None:
                    r.swa_pages.append(int(swa_slots[i]) // ps)
            r.kv_len += 1
        host[3] = slots  # the previous slots are no longer needed: the new ones travel instead
        if swa_slots is not None:
            host[5] = swa_slots
        # window evictions' deferred mapping resets ride along; a slot handed out again in
        # this step keeps its new entry (the kernel does not order the two)
        kv = self.token_to_kv_pool
        resets = kv.take_mapping_resets() if swa_slots is not None else None
        if resets is not None:
            new, gone = set(slots.tolist()), resets.tolist()
            if any(s in new for s in gone):  # (rare: a finished request's slot handed out)
                resets = torch.tensor([s for s in gone if s not in new], dtype=torch.int64)
        # one upload: the block, the slots of each deferred scrub, the resets
        tail = [s for _, s in scrubs] + ([resets] if resets is not None else [])
        flat = self._to_device(torch.cat([host.reshape(-1), *tail]))
        dev = flat[: host.numel()].view(host.shape)  # [5 or 6, B]
        off = host.numel()
        scrub_dev = []  # zeroed before this step's forward writes the new slots
        for pool, s in scrubs:
            scrub_dev.append((pool, flat[off : off + len(s)]))
            off += len(s)
        dest = self.decode_dest(len(reqs), host.shape[0]) if self.decode_dest else None
        extras = StepExtras(
            dest=dest,
            host_ids=host_ids,
            resets=None if resets is None else flat[off:],
            scrubs=scrub_dev,
        )
        r2t = self.req_to_token_pool
        try:
            write_decode_rows(  # the request tables (and the window mapping), scrubs; ids
                dev,  # copied after the step that computes them, when given
                r2t.req_to_token,
                r2t.req_to_swa_token if swa_slots is not None else None,
                kv.full_to_swa_index_mapping if swa_slots is not None else None,
                input_ids,
                extras,
            )
        except BaseException:
            if resets is not None:
                kv.requeue_mapping_resets(resets)
            raise
        dev = dev if dest is None else dest
        input_ids, rows, seq_lens, out_cache_loc, pos = dev[:5].unbind(0)  # [B] each
        finder = self.shared_prefixes if self.tree_cache is not None else None  # read once a group
        return self._forward_batch(
            ForwardMode.DECODE,
            batch_size=len(reqs),
            input_ids=input_ids,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            out_cache_loc=out_cache_loc,
            positions=pos,
            out_cache_loc_swa=dev[5] if swa_slots is not None else None,
            decode_inputs=dev,  # [5 or 6, B]
            shared_prefixes=None if finder is None else finder.find(reqs, ps),
        )

"""The request side of `SWARadixCache`: `cache_finished_req` and `cache_unfinished_req` over
both pools of the hybrid sliding-window KV pool.

A request's page lists (`srt/managers/req.py`): `kv_pages` (full pages, the first
`cache_protected_len // page_size` the tree's), and `swa_pages`, the window pages of token pages
`swa_page_start, swa_page_start + 1, ...` it still reads; entries of token pages below
`cache_protected_len // page_size` are the tree's (read under the request's window lock), the
rest its own. Inserting hands the tree the request's own full pages of new whole pages, and
their window pages where the request still has them (tokens that left its window were already
freed: those pages enter the tree tombstoned). Where the tree already held a page, the
request's copy is freed, except a window page that revives the tree's tombstone there. The
full -> window mapping follows every move: the tree's full slots map to its window pages (-1
when tombstoned), a freed full slot maps to -1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from srt.mem_cache.radix_cache import RadixKey, TreeNode


class SWARequestsMixin:
    """cache_finished_req / cache_unfinished_req of SWARadixCache (its attributes declared
    here for the type checker)."""

    page_size: int
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    kv_pool: Any
    root_node: TreeNode
    _insert: Any
    _path_pages: Any
    _req_key: Any
    _slots: Any
    _free_pages: Any
    window_pages: Any
    inc_lock_ref: Any
    dec_lock_ref: Any

    def _own_swa(self, req: Any) -> list[int]:
        """Per token page of req.kv_pages: the request's own window page, or -1 (none left,
        or the tree's)."""
        first_own = req.cache_protected_len // self.page_size
        out = [-1] * len(req.kv_pages)
        for k, s in enumerate(req.swa_pages):
            i = req.swa_page_start + k
            if first_own <= i < len(out):
                out[i] = s
        return out

    def _release(
        self, pages: Sequence[int], own: Sequence[int], taken: Sequence[bool], idx: Iterable[int]
    ) -> None:
        """Free the request's full pages `pages[i]` (i in idx) and its window pages there,
        except those the tree took (their full slots' mapping is reset instead)."""
        idx = list(idx)
        if not idx:
            return
        free_swa = [i for i in idx if own[i] >= 0 and not (i < len(taken) and taken[i])]
        moved = [i for i in idx if i < len(taken) and taken[i]]
        alloc, ps = self.token_to_kv_pool_allocator, self.page_size
        if free_swa:  # before the full pages: free_swa checks its full slots are allocated
            first = torch.tensor([own[i] for i in free_swa], dtype=torch.int64) * ps
            alloc.free_swa(first, self._slots([pages[i] for i in free_swa]))
        if moved:
            self.kv_pool.reset_swa_mapping(self._slots([pages[i] for i in moved]))
        self._free_pages([pages[i] for i in idx])

    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Release a finished request: its computed whole pages go into the tree (`is_insert`)
        with the window pages it still holds; duplicates, its partial last page and every
        other own page of both pools are freed; its locks and its row are given back."""
        ps = self.page_size
        pages, first_own = req.kv_pages, req.cache_protected_len // ps
        own = self._own_swa(req)
        taken: list[bool] = []
        n_full = dup_end = first_own
        if is_insert and req.kv_len > 0:
            key = self._req_key(req, req.kv_len)
            n_full = len(key) // ps
            matched, taken = self._insert(key, pages, own[:n_full])
            if matched < req.cache_protected_len:
                raise RuntimeError(f"request {req.rid}: its locked prefix left the tree")
            dup_end = matched // ps
        # [first_own, dup_end): the tree had them; [dup_end, n_full): the tree's now
        self._release(pages, own, taken, [*range(first_own, dup_end), *range(n_full, len(pages))])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        row = req.req_pool_idx
        req.kv_pages, req.kv_len, req.req_pool_idx = [], 0, None
        req.swa_pages, req.swa_page_start = [], 0
        req.cache_protected_len, req.last_node = 0, None
        if row is not None:
            self.req_to_token_pool.free(row)

    def _lockable_key(self, req: Any, key: RadixKey, own: Sequence[int]) -> RadixKey:
        """key cut to the longest whole-page prefix whose last W tokens have window pages
        (the tree's or the request's own), which the request can then lock. Right after a
        forward that is all of it; a request that gave back window pages since (the window
        eviction after a step) may have freed some of them."""
        ps, first_own = self.page_size, req.cache_protected_len // self.page_size
        tree_swa = self._path_pages(key)[1]
        live = [
            own[i] >= 0 or (i < len(tree_swa) and tree_swa[i] >= 0) for i in range(len(key) // ps)
        ]
        for m in range(len(live), first_own, -1):
            lo, hi = self.window_pages(m * ps)
            if all(live[lo:hi]):
                break
        else:
            m = first_own
        return RadixKey(key.token_ids[: m * ps], key.extra_key)

    def cache_unfinished_req(self, req: Any) -> None:
        """Put a running request's computed whole pages into the tree (after its prompt or a
        chunk of it; up to where it can lock their window: `_lockable_key`): from here on it
        reads them from the tree's pages in both pools (its duplicates freed, its
        req_to_token / req_to_swa_token rows rewritten) and holds the locks of the new path
        instead of the old."""
        ps = self.page_size
        if req.req_pool_idx is None:
            raise ValueError(f"request {req.rid} holds no req_to_token row")
        own = self._own_swa(req)
        key = self._lockable_key(req, self._req_key(req, req.kv_len), own)
        n_full, first_own = len(key) // ps, req.cache_protected_len // ps
        matched, taken = self._insert(key, req.kv_pages, own[:n_full])
        if matched < req.cache_protected_len:
            raise RuntimeError(f"request {req.rid}: its locked prefix left the tree")
        full, swa, last = self._path_pages(key)
        if len(full) != n_full:
            raise RuntimeError(f"request {req.rid}: the tree lost a page it just took")
        dups = range(first_own, matched // ps)
        row, r2t = req.req_pool_idx, self.req_to_token_pool
        # window pages the tree already had live: the request reads the tree's from now on
        swapped = [i for i in dups if own[i] >= 0 and not taken[i]]
        for i in swapped:
            req.swa_pages[i - req.swa_page_start] = swa[i]
        if len(dups):
            pos = dups[0] * ps
            dest = self._slots(full[dups[0] : dups[-1] + 1]).to(r2t.req_to_token.device)
            r2t.req_to_token[row, pos : pos + len(dest)] = dest.to(torch.int32)
        if swapped:
            cols = self._slots(swapped)  # the positions of pages i are the slots of "page" i
            dev = r2t.req_to_swa_token.device
            dest = self._slots([swa[i] for i in swapped]).to(dev, torch.int32)
            r2t.req_to_swa_token[row, cols.to(dev)] = dest
        self._release(req.kv_pages, own, taken, dups)
        req.kv_pages = full + req.kv_pages[n_full:]
        self.inc_lock_ref(last)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.cache_protected_len = last, len(key)
        lo, _ = self.window_pages(len(key))
        if req.swa_page_start < lo:  # the tree's pages no later query of it reads
            del req.swa_pages[: lo - req.swa_page_start]
            req.swa_page_start = lo

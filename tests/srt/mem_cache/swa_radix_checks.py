"""Invariants of the SWA radix cache over a hybrid pool, shared by its unit/property tests, the
scheduler's tests and the stress test: the full pool's (radix_checks.check_ownership), and the
window pool's: every window page held by exactly one of the free list, the tree (live
`swa_value` entries) and one running request (its own `swa_pages`); a request reads the tree's
window pages of its prefix's last W tokens, locked; lock counts and window sizes exact; the
full -> window mapping exactly what the host lists say."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from srt.mem_cache.swa_radix_cache import SWARadixCache
from tests.srt.mem_cache.radix_checks import check_ownership


def _path_nodes(tree: SWARadixCache, node: Any) -> list[Any]:
    out = []
    while node is not None and node is not tree.root_node:
        out.append(node)
        node = node.parent
    return out[::-1]


def own_swa(r: Any, ps: int) -> dict[int, int]:
    """Token page -> the request's own window page."""
    first = max(r.swa_page_start, r.cache_protected_len // ps)
    return {
        r.swa_page_start + k: p for k, p in enumerate(r.swa_pages) if r.swa_page_start + k >= first
    }


def check_swa_ownership(tree: SWARadixCache | None, alloc: Any, running: Sequence[Any]) -> None:
    """Both pools' ownership, the window locks and sizes, and the mapping (see the module
    docstring)."""
    check_ownership(tree, alloc.full_attn_allocator, running)
    ps, w = alloc.page_size, getattr(tree, "sliding_window_size", 0)
    live = [r for r in running if r.req_pool_idx is not None or r.kv_pages]
    nodes = list(tree.nodes()) if tree is not None else []
    tree_swa = [s for x in nodes for s in x.swa_value if s >= 0]
    owned: list[int] = []
    locks: dict[tuple[int, int], int] = {}
    for r in live:
        mine = own_swa(r, ps)
        owned += mine.values()
        n_tree = r.cache_protected_len // ps
        assert r.swa_page_start + len(r.swa_pages) == len(r.kv_pages) or r.kv_len == 0, (
            f"request {r.rid}: window pages do not reach its last page"
        )
        if tree is None or r.last_node is None:
            continue
        path = _path_nodes(tree, r.last_node)
        swa_path = [s for x in path for s in x.swa_value]
        for k, p in enumerate(r.swa_pages):  # the tree's entries are the path's
            if r.swa_page_start + k < n_tree:
                assert p == swa_path[r.swa_page_start + k] >= 0, "reads a tree page it lost"
        lo = max(0, r.cache_protected_len - w) // ps
        assert r.swa_page_start >= lo, f"request {r.rid} reads window pages it has not locked"
        start = 0
        for x in path:
            for j in range(len(x.value)):
                if lo <= start + j < n_tree:
                    locks[(id(x), j)] = locks.get((id(x), j), 0) + 1
            start += len(x.value)
    swa_alloc = alloc.swa_attn_allocator
    every = sorted(swa_alloc.free_pages.tolist() + tree_swa + owned)
    assert every == list(range(1, swa_alloc.num_pages + 1)), "a window page leaked or is shared"
    if tree is not None:
        for x in nodes:
            assert len(x.swa_value) == len(x.swa_lock) == len(x.value)
            for j, s in enumerate(x.swa_value):
                assert x.swa_lock[j] == locks.get((id(x), j), 0), "window lock count differs"
                assert s >= 0 or not x.swa_lock[j], "a locked window page was tombstoned"
        ev = sum(
            ps for x in nodes for j, s in enumerate(x.swa_value) if s >= 0 and not x.swa_lock[j]
        )
        assert tree.swa_evictable_size() == ev
        assert tree.swa_protected_size() == len(tree_swa) * ps - ev
    check_mapping(tree, alloc, live)


def check_mapping(tree: SWARadixCache | None, alloc: Any, live: Sequence[Any]) -> None:
    """The pool's full -> window mapping (deferred resets applied) equals the host lists':
    a tree page's tokens map to its window page (-1: tombstoned), a request's own tokens to its
    own window slots (-1: left the window), every other slot but the padding page's to -1."""
    pool, ps = alloc.get_kvcache(), alloc.page_size
    got = pool.full_to_swa_index_mapping.to("cpu").clone()
    for pending in pool._pending_resets:
        got[pending] = -1
    want = torch.full_like(got, -1)
    want[:ps] = torch.arange(ps)
    offs = torch.arange(ps)
    for x in tree.nodes() if tree is not None else ():
        for p, s in zip(x.value, x.swa_value, strict=True):
            want[p * ps + offs] = s * ps + offs if s >= 0 else -1
    for r in live:
        for i, s in own_swa(r, ps).items():
            n = min(ps, r.kv_len - i * ps)  # tokens written in the page
            want[r.kv_pages[i] * ps + offs[:n]] = s * ps + offs[:n]
    bad = (got != want).nonzero().reshape(-1)
    assert bad.numel() == 0, (
        f"mapping of full slot {int(bad[0])} is {int(got[bad[0]])}, want {int(want[bad[0]])}"
    )


def swa_kv_bytes(pool: Any) -> list[torch.Tensor]:
    """radix_checks.kv_bytes of the window pool."""
    from tests.srt.mem_cache.radix_checks import kv_bytes

    return kv_bytes(pool.swa_kv_pool)


def swa_referenced_slots(tree: SWARadixCache | None, running: Sequence[Any], ps: int) -> set[int]:
    """Window slots someone still reads: the tree's live window pages, and each running
    request's window slots of its written tokens."""
    out: set[int] = set()
    for x in tree.nodes() if tree is not None else ():
        for s in x.swa_value:
            if s >= 0:
                out.update(range(s * ps, (s + 1) * ps))
    for r in running:
        for k, p in enumerate(r.swa_pages):
            first = (r.swa_page_start + k) * ps
            out.update(p * ps + i for i in range(min(ps, r.kv_len - first)))
    return out

"""SWARadixCache: the prefix cache over the hybrid sliding-window KV pool (`SWAKVPool`).

SGLang's `SWARadixCache` idea, this runtime's own code over its host page lists. Every cached
token keeps its *full* page (the full-attention layers read the whole prefix); its *window*
page (the sliding-window layers) may be freed while the full page stays: the page is then
tombstoned (`SWATreeNode.swa_value[j] == -1`) and the pool's full -> window mapping of its
tokens says "no window slot" (-1).

Match rule. A request that starts from a cached prefix of L tokens first computes position L,
whose window layers read tokens L - W .. L (W = the pool's window-left, `sliding_window_size`;
a query at p reads p - W .. p). So a prefix of L tokens is usable only if tokens
max(0, L - W) .. L - 1 all still have window slots: token pages max(0, L - W) // page_size ..
L // page_size - 1 are live. `match_prefix` returns the longest such whole-page prefix of the
full match (the node is split there).

Locks. `inc_lock_ref(node)` locks the full path root -> node (as RadixCache) and, page by page,
the window pages of the last W tokens above node (the pages the request reads from the tree):
`swa_lock[j]` counts the requests that read window page j of a node. Counts live on pages, so a
node split keeps them exact, and `dec_lock_ref(node)` finds the same range again from the
node's depth. A locked window page is never tombstoned; a full-locked node is never deleted.

Sizes (tokens): `evictable_size` / `protected_size` of the full pages as RadixCache;
`swa_evictable_size` / `swa_protected_size` count the live window pages by their lock. All four
are kept exact on every change.

Eviction. `evict(n)` deletes unlocked leaves, least recently used first, freeing their full and
their live window pages. `evict_swa(n)` tombstones live unlocked window pages, least recently
used node first and within a node front pages first (a match ending at the node's end needs
its last pages), keeping every full page: it serves the window pool's pressure.

Ownership of window pages: each is held by exactly one of the window allocator's free list, a
node (`swa_value`), or one running request (the pages of `Req.swa_pages` of token pages at or
past its `cache_protected_len`; the front entries below it are the tree's, which the request
reads under its lock and never frees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from srt.mem_cache.radix_cache import MatchResult, RadixCache, RadixKey, TreeNode
from srt.mem_cache.swa_radix_requests import SWARequestsMixin


class SWATreeNode(TreeNode):
    """A node with a window page per full page (`swa_value`, -1: tombstoned) and a lock count
    per window page (`swa_lock`)."""

    __slots__ = ("swa_value", "swa_lock")

    def __init__(
        self,
        parent: TreeNode | None,
        key: tuple[int, ...],
        value: list[int],
        extra_key: str | None = None,
        swa_value: Sequence[int] | None = None,
    ) -> None:
        super().__init__(parent, key, value, extra_key)
        self.swa_value: list[int] = [-1] * len(value) if swa_value is None else list(swa_value)
        self.swa_lock: list[int] = [0] * len(value)


@dataclass(frozen=True)
class SWAMatchResult(MatchResult):
    """MatchResult plus the window page of each matched page (-1: tombstoned; only pages
    before the last W tokens of the match can be)."""

    swa_pages: tuple[int, ...] = ()


def _as_swa(node: TreeNode) -> SWATreeNode:
    assert isinstance(node, SWATreeNode)
    return node


class SWARadixCache(SWARequestsMixin, RadixCache):
    """The prefix tree over a hybrid pool (see the module docstring).

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool with `req_to_swa_token`.
    token_to_kv_pool_allocator : SWATokenToKVPoolAllocator (its `get_kvcache()` is the
        SWAKVPool whose mapping the tree keeps current).
    page_size : tokens per page.
    sliding_window_size : the pool's window-left W (a query at p reads p - W .. p).
    """

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        page_size: int,
        sliding_window_size: int,
    ) -> None:
        w = sliding_window_size
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"sliding_window_size must be an int >= 1, got {w!r}")
        if not hasattr(token_to_kv_pool_allocator, "free_swa"):
            raise TypeError("SWARadixCache needs an SWATokenToKVPoolAllocator")
        self.sliding_window_size = w
        self.kv_pool = token_to_kv_pool_allocator.get_kvcache()
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    # ------------------------------------------------------------------ public API
    def reset(self) -> None:
        """An empty tree (pages not freed: evict first); the pool's mapping made current."""
        self.kv_pool.flush_mapping_resets()
        super().reset()
        self.root_node = SWATreeNode(None, (), [])
        self.root_node.lock_ref = 1
        self.swa_evictable_size_ = 0
        self.swa_protected_size_ = 0

    def window_pages(self, num_tokens: int) -> tuple[int, int]:
        """Token pages [lo, hi) whose window slots a request starting at `num_tokens` reads."""
        ps = self.page_size
        return max(0, num_tokens - self.sliding_window_size) // ps, num_tokens // ps

    def match_prefix(self, key: RadixKey) -> SWAMatchResult:
        """The longest cached whole-page prefix of `key` whose last W tokens all have window
        slots (the node is split where it ends). Touches the matched path (LRU)."""
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        path = self._swa_path(key.page_aligned(self.page_size))
        swa = [s for n in path for s in n.swa_value]
        m = self._usable_pages(swa)
        node = self._node_ending_at(path, m)
        full = [p for n in path for p in n.value][:m]
        return SWAMatchResult(tuple(full), m * self.page_size, node, tuple(swa[:m]))

    def insert(self, key: RadixKey, value: Sequence[int], swa_value: Sequence[int] = ()) -> int:
        """RadixCache.insert with the window page of each page of key (`swa_value`, -1: none;
        empty: none at all). The tree takes the window pages of its new pages and revives its
        tombstoned pages with the caller's; the caller frees the rest (see `_insert`)."""
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        key = key.page_aligned(self.page_size)
        n = len(key) // self.page_size
        swa = list(swa_value) if len(swa_value) else [-1] * n
        if len(value) < n or len(swa) < n:
            raise ValueError(f"value / swa_value have {len(value)} / {len(swa)} pages for {n}")
        return self._insert(key, value, swa)[0]

    def _evicting(self, leaf: TreeNode) -> None:
        """`evict` (RadixCache's, which frees full and live window pages and counts full
        tokens): the leaf's window pages first, as free_swa checks the full ones."""
        c = _as_swa(leaf)
        self._tombstone(c, [j for j, s in enumerate(c.swa_value) if s >= 0])

    def evict_swa(self, num_tokens: int) -> int:
        """Tombstone live unlocked window pages (least recently used node first, front pages
        of a node first) until `num_tokens` window slots were freed or none is left; every
        full page stays. Returns the window slots freed."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        freed = 0
        if num_tokens == 0:
            return 0
        nodes = sorted((_as_swa(n) for n in self.nodes()), key=lambda n: (n.last_access, n.id))
        for node in nodes:
            pages = [j for j, s in enumerate(node.swa_value) if s >= 0 and not node.swa_lock[j]]
            take = pages[: -(-(num_tokens - freed) // self.page_size)]
            self._tombstone(node, take)
            freed += len(take) * self.page_size
            if freed >= num_tokens:
                break
        return freed

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the full path root -> node and the window pages of its last W tokens (they
        must be live); returns the change of evictable_size (<= 0)."""
        self._lock_window(_as_swa(node), +1)
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change of evictable_size (>= 0)."""
        self._lock_window(_as_swa(node), -1)
        return super().dec_lock_ref(node)

    def swa_evictable_size(self) -> int:
        return self.swa_evictable_size_

    def swa_protected_size(self) -> int:
        return self.swa_protected_size_

    def swa_total_size(self) -> int:
        """Window slots the tree holds (a walk)."""
        return self.held_swa_count() * self.page_size

    def held_swa_count(self) -> int:
        return sum(s >= 0 for n in self.nodes() for s in _as_swa(n).swa_value)

    def held_swa_pages(self) -> set[int]:
        """Every window page the tree holds (a walk; for checks)."""
        return {s for n in self.nodes() for s in _as_swa(n).swa_value if s >= 0}

    # ------------------------------------------------------------------ internals
    def _swa_path(self, key: RadixKey) -> list[SWATreeNode]:
        return [_as_swa(n) for n in self._descend(key)]

    def _usable_pages(self, swa: list[int]) -> int:
        """The most pages m of a path (window pages `swa`) whose window range is all live."""
        last_dead = -1
        dead_upto = []  # dead_upto[i]: the last tombstoned page index <= i (-1: none)
        for i, s in enumerate(swa):
            if s < 0:
                last_dead = i
            dead_upto.append(last_dead)
        for m in range(len(swa), 0, -1):
            lo, _ = self.window_pages(m * self.page_size)
            if dead_upto[m - 1] < lo:
                return m
        return 0

    def _node_ending_at(self, path: list[SWATreeNode], m: int) -> TreeNode:
        """The node of `path` whose end is page m (splitting the one that holds it)."""
        if m == 0:
            return self.root_node
        end = 0
        for node in path:
            start, end = end, end + len(node.value)
            if end == m:
                return node
            if end > m:
                return self._split(node, (m - start) * self.page_size)
        return path[-1]

    def _upper_node(self, child: TreeNode, n: int) -> TreeNode:
        """RadixCache._split's upper node, with the window pages and lock counts of its pages."""
        c = _as_swa(child)
        k = n // self.page_size
        upper = SWATreeNode(c.parent, c.key[:n], c.value[:k], c.extra_key, c.swa_value[:k])
        upper.swa_lock = c.swa_lock[:k]
        c.swa_value, c.swa_lock = c.swa_value[k:], c.swa_lock[k:]
        return upper

    def _insert(
        self, key: RadixKey, value: Sequence[int], swa: Sequence[int]
    ) -> tuple[int, list[bool]]:
        """Insert key (whole pages) with full pages `value` and window pages `swa` (-1: none).
        Returns (tokens the tree already held, taken): taken[i] is True where the tree now
        holds the caller's window page of page i (a new page, or a tombstone revived: the
        tree's full slots then map to it; the caller resets its own full slots' mapping).
        RadixCache's walk, with the window pages added by its two hooks."""
        ps, ids = self.page_size, key.token_ids
        end = len(ids) // ps
        taken = [False] * end
        revived_full: list[int] = []
        revived_swa: list[int] = []

        def new_node(parent: TreeNode, pos: int) -> TreeNode:
            first = pos // ps
            pages = list(map(int, value[first:end]))
            new_swa = list(map(int, swa[first:end]))
            self.swa_evictable_size_ += sum(s >= 0 for s in new_swa) * ps
            for j, s in enumerate(new_swa):
                taken[first + j] = s >= 0
            return SWATreeNode(parent, ids[pos:], pages, key.extra_key, new_swa)

        def matched(node: TreeNode, first: int) -> None:
            c = _as_swa(node)
            for j in range(len(c.value)):
                s = int(swa[first + j])
                if c.swa_value[j] < 0 and s >= 0:  # a tombstone revived by the caller's page
                    c.swa_value[j] = s
                    self.swa_evictable_size_ += ps  # (a tombstoned page is never locked)
                    taken[first + j] = True
                    revived_full.append(c.value[j])
                    revived_swa.append(s)

        pos = self._insert_walk(key, value, new_node, matched)
        if revived_full:
            self.kv_pool.set_swa_mapping(self._slots(revived_full), self._slots(revived_swa))
        return pos, taken

    def _tombstone(self, node: SWATreeNode, idx: list[int]) -> None:
        """Free the window pages idx of node (live, unlocked); its tokens' mapping -> -1."""
        if not idx:
            return
        swa = [node.swa_value[j] for j in idx]
        if any(s < 0 for s in swa) or any(node.swa_lock[j] for j in idx):
            raise RuntimeError("tombstoning a window page that is gone or locked")
        first = torch.tensor(swa, dtype=torch.int64) * self.page_size
        full = self._slots([node.value[j] for j in idx])
        self.token_to_kv_pool_allocator.free_swa(first, full)
        for j in idx:
            node.swa_value[j] = -1
        self.swa_evictable_size_ -= len(idx) * self.page_size

    def _depth(self, node: TreeNode) -> int:
        n = 0
        while node is not self.root_node:
            n += len(node.key)
            node = self._parent(node)
        return n

    def _lock_window(self, node: SWATreeNode, delta: int) -> None:
        """Add delta to the lock count of the window pages of node's last W tokens (checked
        first: live pages, and locked ones for an unlock; nothing changes on an error)."""
        lo, hi = self.window_pages(self._depth(node))
        spans: list[tuple[SWATreeNode, int]] = []  # (node, first page index in it)
        end, n = hi, node
        while n is not self.root_node and end > lo:
            start = end - len(n.value)
            spans.append((n, max(0, lo - start)))
            end, n = start, _as_swa(self._parent(n))
        for n, j0 in spans:
            for j in range(j0, len(n.value)):
                if n.swa_value[j] < 0:
                    raise RuntimeError("locking a window page of the tree that was tombstoned")
                if delta < 0 and n.swa_lock[j] <= 0:
                    raise RuntimeError("dec_lock_ref on a window page that is not locked")
        ps = self.page_size
        for n, j0 in spans:
            for j in range(j0, len(n.value)):
                before = n.swa_lock[j]
                n.swa_lock[j] = before + delta
                if before == 0:
                    self.swa_evictable_size_ -= ps
                    self.swa_protected_size_ += ps
                elif before + delta == 0:
                    self.swa_evictable_size_ += ps
                    self.swa_protected_size_ -= ps

    def _path_pages(self, key: RadixKey) -> tuple[list[int], list[int], TreeNode]:
        """Full and window pages of key's cached prefix and its last node (no window rule)."""
        path = self._swa_path(key)
        full = [p for n in path for p in n.value]
        swa = [s for n in path for s in n.swa_value]
        return full, swa, (path[-1] if path else self.root_node)

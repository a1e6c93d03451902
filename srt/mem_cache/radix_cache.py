"""RadixCache: SGLang's prefix cache, a radix tree of token ids over the KV pool's pages.

Names and semantics follow SGLang's `srt/mem_cache/radix_cache.py` (`match_prefix`, `insert`,
`evict`, `inc_lock_ref` / `dec_lock_ref`, `cache_finished_req`, `cache_unfinished_req`,
`evictable_size`, `protected_size`, `total_size`, `reset`); the code is this runtime's own,
over its host page lists (`Req.kv_pages`, the allocator's pages).

Ownership: every page of the pool is held by exactly one of the allocator's free list, the
tree (a node's `value`), or one running request (the pages of `Req.kv_pages` past its
`cache_protected_len`). A request's first `cache_protected_len` tokens sit in pages of the
tree's path to `Req.last_node`, which the request keeps locked (`inc_lock_ref`) while it runs:
a locked node is never evicted, and nothing ever writes into a page the tree holds (requests
write only tokens past their page-aligned prefix, in pages of their own).

Keys are page-aligned: with page_size > 1 only whole pages enter the tree, so a match is a
whole number of pages and the next token of a request that matched starts a fresh page. A
node's key holds `len(value) * page_size` token ids. `RadixKey.extra_key` namespaces the tree:
keys with different extra keys never share a node.

Sizes are in tokens. `evictable_size()` counts the tokens of unlocked nodes, `protected_size()`
those of locked ones; both are kept exact on every change (tests check them against a walk).
Eviction takes unlocked leaves in least-recently-used order (a logical clock ticks on every
match and insert, so order does not depend on the wall clock's resolution).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RadixKey:
    """Token ids and the namespace they are matched in (SGLang's RadixKey).

    token_ids : the tokens, in order.
    extra_key : requests with different extra keys (LoRA, cache salt, ...) never share a node.
    """

    token_ids: tuple[int, ...]
    extra_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(self.token_ids))

    def __len__(self) -> int:
        return len(self.token_ids)

    def page_aligned(self, page_size: int) -> RadixKey:
        """The key cut to whole pages."""
        n = len(self.token_ids) // page_size * page_size
        return self if n == len(self.token_ids) else RadixKey(self.token_ids[:n], self.extra_key)


class TreeNode:
    """One edge of the tree: `key` (token ids, whole pages) and `value` (their page ids)."""

    __slots__ = ("children", "parent", "key", "value", "extra_key", "lock_ref", "last_access", "id")
    _next_id = 0

    def __init__(
        self,
        parent: TreeNode | None,
        key: tuple[int, ...],
        value: list[int],
        extra_key: str | None = None,
    ) -> None:
        self.children: dict[Any, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.extra_key = extra_key  # the namespace of its key (RadixKey.extra_key)
        self.lock_ref = 0
        self.last_access = 0
        self.id = TreeNode._next_id
        TreeNode._next_id += 1

    def __lt__(self, other: TreeNode) -> bool:  # heap order: least recently used first
        return (self.last_access, self.id) < (other.last_access, other.id)


@dataclass(frozen=True)
class MatchResult:
    """What `match_prefix` found.

    pages : page ids of the matched tokens, in token order (for page_size 1: the slots).
    prefix_len : matched tokens (len(pages) * page_size).
    last_node : the node the match ends at (the root for none); lock it to keep the pages.
    """

    pages: tuple[int, ...]
    prefix_len: int
    last_node: TreeNode


class RadixCache:
    """The prefix tree over one KV pool.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool (rows of finished requests are freed here; the rows of
        requests that switch to the tree's pages are rewritten by `cache_unfinished_req`).
    token_to_kv_pool_allocator : the (paged) allocator whose pages the tree holds; `free` gives
        pages back.
    page_size : tokens per page.
    """

    def __init__(
        self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, page_size: int
    ) -> None:
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.reset()

    # ------------------------------------------------------------------ public API
    def reset(self) -> None:
        """An empty tree. Its pages are not freed: pair with the allocator's `clear()`."""
        self.root_node = TreeNode(None, (), [])
        self.root_node.lock_ref = 1  # never evicted, never counted
        self._clock = 0
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self._evictable_leaves: set[TreeNode] = set()
        # (last_access, id, leaf) of the evictable leaves, kept across evictions (LRU order
        # without a heapify of every leaf per call): an entry is pushed when a leaf becomes
        # evictable; one whose leaf is gone is dropped, one whose leaf was touched since is
        # pushed again with its new time when it reaches the top (`_pop_lru_leaf`).
        self._lru_heap: list[tuple[int, int, TreeNode]] = []

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The longest cached prefix of `key` (cut to whole pages); may split a node so the
        match ends on a node boundary. Touches the matched path (LRU)."""
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        path = self._descend(key.page_aligned(self.page_size))
        pages = tuple(itertools.chain.from_iterable(n.value for n in path))
        return MatchResult(pages, len(pages) * self.page_size, path[-1] if path else self.root_node)

    def insert(self, key: RadixKey, value: Sequence[int]) -> int:
        """Add `key` (cut to whole pages) with its pages `value`; returns how many of its tokens
        the tree already held (their pages in `value` stay the caller's: free them if unused).

        Parameters
        ----------
        key : the tokens.
        value : page ids (slots for page_size 1), at least one per whole page of key.
        """
        if not isinstance(key, RadixKey):
            raise TypeError(f"key must be a RadixKey, got {type(key).__name__}")
        key = key.page_aligned(self.page_size)
        ps, ids = self.page_size, key.token_ids
        if len(value) < len(ids) // ps:
            raise ValueError(f"value has {len(value)} pages for a key of {len(ids) // ps} pages")
        return self._insert_walk(key, value)

    def _insert_walk(
        self,
        key: RadixKey,
        value: Sequence[int],
        new_node: Callable[[TreeNode, int], TreeNode] | None = None,
        matched: Callable[[TreeNode, int], None] | None = None,
    ) -> int:
        """The walk of `insert` (key whole pages, value checked): returns the tokens the tree
        already held. A subclass's insert passes hooks: `new_node(parent, pos)` builds the node
        of ids[pos:] (default: a TreeNode with value's pages; its sizes are counted here), and
        `matched(node, first_page)` sees every node the key runs through (split to end where
        the key leaves it)."""
        ps, ids = self.page_size, key.token_ids
        self._clock += 1
        node, pos = self.root_node, 0
        node.last_access = self._clock
        while pos < len(ids):
            ck = self._child_key(key.extra_key, ids, pos)
            child = node.children.get(ck)
            if child is None:
                if new_node is None:
                    pages = list(map(int, value[pos // ps : len(ids) // ps]))
                    new = TreeNode(node, ids[pos:], pages, key.extra_key)
                else:
                    new = new_node(node, pos)
                new.last_access = self._clock
                node.children[ck] = new
                self.evictable_size_ += len(new.key)
                self._update_leaf(node)
                self._update_leaf(new)
                break
            child.last_access = self._clock
            n = self._common_len(child.key, ids, pos)
            if n == 0:  # (never: a child's first page is the key's)
                break
            if n < len(child.key):
                child = self._split(child, n)
            if matched is not None:
                matched(child, pos // ps)
            node, pos = child, pos + n
        return pos

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` tokens were
        freed or none is left; returns the tokens freed."""
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
        freed, pages = 0, []
        while freed < num_tokens and (leaf := self._pop_lru_leaf()) is not None:
            self._evicting(leaf)
            pages += leaf.value
            freed += len(leaf.key)
            self._delete_leaf(leaf)
        self._free_pages(pages)  # after every leaf's _evicting, in one allocator call
        return freed

    def _evicting(self, leaf: TreeNode) -> None:
        """A subclass's per-leaf state, given back before the leaf's pages are freed."""

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root -> node (its pages are then never evicted); returns the change
        of evictable_size (<= 0)."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.key)
                self.protected_size_ += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            self._update_leaf(node)
            node = self._parent(node)
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change of evictable_size (>= 0)."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on a node that is not locked")
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.key)
                self.protected_size_ -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            self._update_leaf(node)
            node = self._parent(node)
        return delta

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Tokens in the tree (a walk)."""
        return sum(len(n.key) for n in self.nodes())

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def held_pages(self) -> set[int]:
        """Every page the tree holds (a walk; for checks)."""
        return {p for n in self.nodes() for p in n.value}

    # ------------------------------------------------------------------ requests
    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Release a finished request: its computed tokens' whole pages go into the tree
        (`is_insert`; pages the tree already had for them are freed), the rest of its own pages
        are freed, its lock and its req_to_token row are given back."""
        ps = self.page_size
        pages, own_from = req.kv_pages, req.cache_protected_len // ps
        free = pages[own_from:]
        if is_insert and req.kv_len > 0:
            key = self._req_key(req, req.kv_len)
            matched = self.insert(key, pages)
            if matched < req.cache_protected_len:
                raise RuntimeError(f"request {req.rid}: its locked prefix left the tree")
            n_full = len(key) // ps
            free = pages[own_from : matched // ps] + pages[n_full:]  # duplicates, partial page
        self._free_pages(free)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        row = req.req_pool_idx
        req.kv_pages, req.kv_len, req.req_pool_idx = [], 0, None
        req.cache_protected_len, req.last_node = 0, None
        if row is not None:
            self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: Any) -> None:
        """Put a running request's computed whole pages into the tree (a chunk boundary): from
        here on it reads those tokens from the tree's pages (its duplicates are freed and its
        req_to_token row rewritten) and holds the lock of the new path instead of the old."""
        ps = self.page_size
        if req.req_pool_idx is None:
            raise ValueError(f"request {req.rid} holds no req_to_token row")
        key = self._req_key(req, req.kv_len)
        matched = self.insert(key, req.kv_pages)
        if matched < req.cache_protected_len:
            raise RuntimeError(f"request {req.rid}: its locked prefix left the tree")
        own_from, n_full = req.cache_protected_len // ps, len(key) // ps
        dup = req.kv_pages[own_from : matched // ps]
        res = self.match_prefix(key)  # the tree's pages of the key (its own or ours)
        if res.prefix_len != len(key):
            raise RuntimeError(f"request {req.rid}: the tree lost a page it just took")
        if dup:
            first = own_from * ps
            slots = self._slots(list(res.pages[own_from : matched // ps]))
            r2t = self.req_to_token_pool.req_to_token
            dest = slots.to(r2t.device, torch.int32)
            r2t[req.req_pool_idx, first : first + len(slots)] = dest
            self._free_pages(dup)
        req.kv_pages = list(res.pages) + req.kv_pages[n_full:]
        self.inc_lock_ref(res.last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node, req.cache_protected_len = res.last_node, len(key)

    # ------------------------------------------------------------------ internals
    def _req_key(self, req: Any, n: int) -> RadixKey:
        ids = (list(req.origin_input_ids) + list(req.output_ids))[:n]
        if len(ids) < n:
            raise RuntimeError(f"request {req.rid}: {n} cached tokens but {len(ids)} token ids")
        return RadixKey(tuple(ids), getattr(req, "extra_key", None)).page_aligned(self.page_size)

    def _child_key(self, extra_key: str | None, ids: tuple[int, ...], pos: int) -> Any:
        """Dict key of the child holding ids[pos:]: its first page, in its namespace."""
        first = ids[pos] if self.page_size == 1 else ids[pos : pos + self.page_size]
        return first if extra_key is None else (extra_key, first)

    def _common_len(self, node_key: tuple[int, ...], ids: tuple[int, ...], pos: int) -> int:
        """Tokens node_key shares with ids[pos:], rounded down to whole pages. Slices compare
        in C: a whole node in one comparison (the usual case), else a bisection of slices; a
        token-by-token loop cost ~50 µs per 1K-token node, on every insert and match."""
        n = min(len(node_key), len(ids) - pos)
        lo, hi = 0, n  # node_key[:lo] == ids[pos : pos + lo]; they differ before hi
        if node_key[:n] == ids[pos : pos + n]:
            lo = n
        while hi - lo > 8:
            mid = (lo + hi) // 2
            if node_key[lo:mid] == ids[pos + lo : pos + mid]:
                lo = mid
            else:
                hi = mid
        while lo < hi and node_key[lo] == ids[pos + lo]:
            lo += 1
        return lo // self.page_size * self.page_size

    def _parent(self, node: TreeNode) -> TreeNode:
        assert node.parent is not None
        return node.parent

    def _descend(self, key: RadixKey) -> list[TreeNode]:
        """The nodes of key's (whole pages) longest cached prefix, root excluded, the last one
        split to end there; touches them (LRU)."""
        self._clock += 1
        node, path = self.root_node, []
        node.last_access = self._clock
        ids, pos = key.token_ids, 0
        while pos < len(ids):
            child = node.children.get(self._child_key(key.extra_key, ids, pos))
            if child is None:
                break
            child.last_access = self._clock
            n = self._common_len(child.key, ids, pos)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            path.append(child)
            node, pos = child, pos + n
        return path

    def _upper_node(self, child: TreeNode, n: int) -> TreeNode:
        """The node of child's first n tokens when it is split (a subclass's node type takes
        its share of the per-page state here)."""
        k = n // self.page_size
        return TreeNode(child.parent, child.key[:n], child.value[:k], child.extra_key)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split child after its first n tokens (whole pages); returns the new upper node,
        which inherits the lock count (the same requests lock both halves) and the dict key
        (its first page is the child's old one)."""
        ps = self.page_size
        parent = self._parent(child)
        ck = self._child_key(child.extra_key, child.key, 0)
        upper = self._upper_node(child, n)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.key, child.value, child.parent = child.key[n:], child.value[n // ps :], upper
        upper.children[self._child_key(child.extra_key, child.key, 0)] = child
        parent.children[ck] = upper
        return upper

    def _delete_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = self._parent(leaf)
        del parent.children[self._child_key(leaf.extra_key, leaf.key, 0)]
        self.evictable_size_ -= len(leaf.key)
        self._evictable_leaves.discard(leaf)
        self._update_leaf(parent)
        return parent

    def _update_leaf(self, node: TreeNode) -> None:
        if node is not self.root_node and node.lock_ref == 0 and not node.children:
            if node not in self._evictable_leaves:
                self._evictable_leaves.add(node)
                heapq.heappush(self._lru_heap, (node.last_access, node.id, node))
        else:
            self._evictable_leaves.discard(node)

    def _pop_lru_leaf(self) -> TreeNode | None:
        """The least recently used evictable leaf, taken off the heap (None: none left)."""
        heap, leaves = self._lru_heap, self._evictable_leaves
        if len(heap) > 2 * len(leaves) + 64:  # mostly stale entries: rebuild
            heap[:] = [(n.last_access, n.id, n) for n in leaves]
            heapq.heapify(heap)
        while heap:
            stamp, _, node = heap[0]
            if node not in leaves:
                heapq.heappop(heap)
            elif stamp != node.last_access:  # touched since: its place is later
                heapq.heapreplace(heap, (node.last_access, node.id, node))
            else:
                heapq.heappop(heap)
                return node
        return None

    def _slots(self, pages: list[int]) -> torch.Tensor:
        """int64 [len(pages) * page_size] host slots of whole pages."""
        ps = self.page_size
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * ps + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    def _free_pages(self, pages: list[int]) -> None:
        if pages:
            first = torch.tensor(pages, dtype=torch.int64) * self.page_size
            self.token_to_kv_pool_allocator.free(first)

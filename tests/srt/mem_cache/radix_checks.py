"""Invariants of the radix cache over a pool, shared by the tree's property tests, the
scheduler's tests and the stress test."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from srt.mem_cache.radix_cache import RadixCache, TreeNode


def path_of(tree: RadixCache, node: TreeNode | None) -> tuple[tuple[int, ...], list[int]]:
    """(tokens, pages) of the path root -> node (empty for None or the root)."""
    keys, pages = [], []
    while node is not None and node is not tree.root_node:
        keys.append(node.key)
        pages.append(node.value)
        node = node.parent
    return tuple(t for k in reversed(keys) for t in k), [p for v in reversed(pages) for p in v]


def check_ownership(tree: RadixCache | None, alloc: Any, running: Sequence[Any]) -> None:
    """Every page is held by exactly one of the free list, the tree and one running request;
    each request's protected prefix is its locked path; lock counts, sizes and the evictable
    leaves are exact."""
    ps = alloc.page_size
    nodes = list(tree.nodes()) if tree is not None else []
    tree_pages = [p for x in nodes for p in x.value]
    assert len(set(tree_pages)) == len(tree_pages), "a page in two nodes"
    owned: list[int] = []
    locks: dict[int, int] = {}
    for r in running:
        if r.req_pool_idx is None and not r.kv_pages:
            continue  # admitted later, or already released
        owned += r.kv_pages[r.cache_protected_len // ps :]
        assert len(r.kv_pages) == -(-r.kv_len // ps), f"request {r.rid}: pages != kv_len"
        if tree is None:
            assert r.cache_protected_len == 0 and r.last_node is None
            continue
        toks, pages = path_of(tree, r.last_node)
        assert pages == r.kv_pages[: r.cache_protected_len // ps], "prefix is not its path"
        assert toks == tuple(r.origin_input_ids + r.output_ids)[: r.cache_protected_len]
        node = r.last_node
        while node is not None and node is not tree.root_node:
            locks[id(node)] = locks.get(id(node), 0) + 1
            node = node.parent
    free = alloc.free_pages.tolist()
    every = sorted(free + tree_pages + owned)
    assert every == list(range(1, alloc.num_pages + 1)), "a page leaked or is held twice"
    if tree is None:
        return
    for x in nodes:
        assert x.key and len(x.key) == len(x.value) * ps
        assert x.lock_ref == locks.get(id(x), 0), "lock count differs from the holders"
    assert tree.evictable_size() == sum(len(x.key) for x in nodes if x.lock_ref == 0)
    assert tree.protected_size() == sum(len(x.key) for x in nodes if x.lock_ref > 0)
    leaves = {id(x) for x in nodes if x.lock_ref == 0 and not x.children}
    assert {id(x) for x in tree._evictable_leaves} == leaves
    assert tree.total_size() == len(tree_pages) * ps


def referenced_slots(tree: RadixCache | None, running: Sequence[Any], ps: int) -> set[int]:
    """Slots whose K/V someone still reads: every slot of the tree's pages, and each running
    request's written tokens (0 .. kv_len - 1)."""
    out: set[int] = set()
    if tree is not None:
        for x in tree.nodes():
            for p in x.value:
                out.update(range(p * ps, (p + 1) * ps))
    for r in running:
        out.update(r.kv_pages[i // ps] * ps + i % ps for i in range(r.kv_len))
    return out


def kv_bytes(pool: Any) -> list[torch.Tensor]:
    """A host copy of every layer's K and V bytes, one [slots, bytes per slot] uint8 tensor
    each (on CUDA the copy waits for the work queued before it)."""
    out = []
    for b in (*pool.k_buffer, *pool.v_buffer):
        rows = b.reshape(pool.num_slots, -1)  # [slots, H * D] (page dims merged)
        out.append(rows.contiguous().view(torch.uint8).to("cpu", copy=True))
    return out


def changed_slots(before: list[torch.Tensor], after: list[torch.Tensor], slots: set[int]):
    """The slots among `slots` whose bytes differ in any layer's K or V."""
    if not slots:
        return []
    idx = torch.tensor(sorted(slots), dtype=torch.int64)
    diff = torch.zeros(len(idx), dtype=torch.bool)
    for b, a in zip(before, after, strict=True):
        diff |= (b[idx] != a[idx]).any(dim=1)
    return idx[diff].tolist()

"""Which decoding requests share leading KV pages: the groups of a cascade decode step.

With the prefix cache, requests that matched the same cached prefix hold the very same pages
for it (the tree's), so attention may read that prefix once per group and step instead of once
per request (`SharedPrefixes`, read by the Triton backend's cascade decode). Everything here is
host data: `Req.kv_pages` (the pages of each request, token order) and `cache_protected_len`
(its leading tokens held in the tree's pages).

Why one page decides: a page of the tree belongs to one node at one depth, so two requests
whose page lists agree at index i agree at every index before it too, and never again after
they first differ. Comparing one page per step of a binary search finds the shared length of
two requests; requests are bucketed by their first page, then by the page where they part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from srt.model_executor.forward_batch_info import SharedPrefixes

# A group's prefix is worth its extra launch and the partial results' traffic when it has at
# least this many tokens ...
MIN_SHARED_TOKENS = 256
# ... and when the reads it saves (the other members' copies) are at least this many tokens.
MIN_SAVED_TOKENS = 2048


def _shared_pages(a: Sequence[int], b: Sequence[int], lo: int, n: int) -> int:
    """Leading pages a and b share among their first n (both the tree's), given that they share
    the first lo: the largest k with a[k - 1] == b[k - 1] (monotone, see the module
    docstring)."""
    hi = n  # a[:lo] == b[:lo]; a[hi:] differs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _groups(
    rows: list[int], depth: int, reqs: Sequence[Any], ps: int
) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    """The best disjoint groups of rows, which share their first `depth` pages: (pages saved,
    [(members, shared pages)]). The rows' shared pages form a trie; a group is one of its nodes
    (all rows below it, their common pages), and a node is taken whole when that saves more than
    the best groups below it ((n - 1) * k reads saved by n requests sharing k pages)."""
    tree = [reqs[i].cache_protected_len // ps for i in rows]
    ref = reqs[rows[0]].kv_pages
    common = min(
        _shared_pages(ref, reqs[i].kv_pages, depth, min(tree[0], t))
        for i, t in zip(rows[1:], tree[1:], strict=True)
    )
    take = (len(rows) - 1) * common
    if common * ps < MIN_SHARED_TOKENS or take * ps < MIN_SAVED_TOKENS:
        take = 0
    below: dict[int, list[int]] = {}  # the rows that go on past `common`, by their next page
    for i, t in zip(rows, tree, strict=True):
        if t > common:
            below.setdefault(reqs[i].kv_pages[common], []).append(i)
    saved, groups = 0, list[tuple[tuple[int, ...], int]]()
    for sub in below.values():
        if len(sub) > 1:
            s, g = _groups(sub, common + 1, reqs, ps)
            saved, groups = saved + s, groups + g
    if take > 0 and take >= saved:
        return take, [(tuple(rows), common)]
    return saved, groups


def find_shared_prefixes(reqs: Sequence[Any], page_size: int) -> SharedPrefixes | None:
    """The groups of reqs (a decode batch, in row order) that share a prefix worth reading once,
    or None when there is none.

    Parameters
    ----------
    reqs : the batch's requests (`Req`: `kv_pages`, `cache_protected_len`, `req_pool_idx`,
        `kv_len`), after the step's slots were taken (kv_len counts the new token).
    page_size : tokens per page.
    """
    ps = page_size
    buckets: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        if r.cache_protected_len >= MIN_SHARED_TOKENS:
            buckets.setdefault(r.kv_pages[0], []).append(i)
    groups, lens, owners = [], [], []
    found = [g for rows in buckets.values() if len(rows) > 1 for g in _groups(rows, 1, reqs, ps)[1]]
    for members, pages in found:
        # never the new token (kv_len - 1 is its position; the tree's pages precede it)
        prefix = min(pages * ps, *(reqs[i].kv_len - 1 for i in members))
        prefix -= prefix % ps
        if prefix < MIN_SHARED_TOKENS:
            continue
        groups.append(members)
        lens.append(prefix)
        owners.append(int(reqs[members[0]].req_pool_idx))
    if not groups:
        return None
    return SharedPrefixes(tuple(groups), tuple(lens), tuple(owners))


class SharedPrefixFinder:
    """`find_shared_prefixes` over a run of decode steps: the groups are found again only when
    the batch's requests or their tree-held lengths change (the tree's pages of a request never
    change while its `cache_protected_len` stays; a prefix found before stays below the new
    token as kv_len grows). It holds the last batch's requests, so an identity is never
    reused while compared."""

    def __init__(self) -> None:
        self._reqs: tuple[Any, ...] = ()
        self._lens: list[int] = []
        self._found: SharedPrefixes | None = None

    def find(self, reqs: Sequence[Any], page_size: int) -> SharedPrefixes | None:
        lens = [r.cache_protected_len for r in reqs]
        same = len(reqs) == len(self._reqs) and lens == self._lens
        if not (same and all(a is b for a, b in zip(reqs, self._reqs, strict=True))):
            self._found = find_shared_prefixes(reqs, page_size)
            self._reqs, self._lens = tuple(reqs), lens
        return self._found

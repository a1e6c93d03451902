"""RadixCache: matching, page alignment, namespaces, locks, LRU eviction, and property tests of
random request lifecycles that keep every invariant (each page held by exactly one of the free
list, the tree and one running request; sizes exact; locked paths kept; LRU order; the bytes of
every cached token unchanged)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.managers.schedule_batch import Req
from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode
from srt.sampling.sampling_params import SamplingParams
from tests.srt.mem_cache.radix_checks import check_ownership, path_of


def _cache(page_size: int, pages: int = 64, rows: int = 8) -> RadixCache:
    alloc = PagedTokenToKVPoolAllocator(pages * page_size, page_size, "cpu")
    return RadixCache(ReqToTokenPool(rows, 256, "cpu"), alloc, page_size)


def _alloc_pages(tree: RadixCache, n: int) -> list[int]:
    ps = tree.page_size
    got = tree.token_to_kv_pool_allocator.alloc(n * ps)
    assert got is not None
    return (got[::ps] // ps).tolist()


def _path(tree: RadixCache, node: TreeNode) -> tuple[tuple[int, ...], list[int]]:
    return path_of(tree, node)


# ----------------------------------------------------------------------------- units
@pytest.mark.parametrize("ps", [1, 4])
def test_match_insert_split_and_page_alignment(ps):
    tree = _cache(ps)
    a = list(range(100, 100 + 5 * ps + (2 if ps > 1 else 0)))  # 5 whole pages (and 2 tokens)
    pages = _alloc_pages(tree, 5)
    assert tree.insert(RadixKey(a), pages) == 0
    assert tree.total_size() == tree.evictable_size() == 5 * ps  # the partial page left out
    m = tree.match_prefix(RadixKey(a))
    assert m.prefix_len == 5 * ps and list(m.pages) == pages
    # a key diverging inside page 3 matches 2 whole pages (for ps 1: 2 tokens + 1)
    b = a[: 2 * ps + 1] + [7] + a[2 * ps + 2 :]
    m = tree.match_prefix(RadixKey(b))
    want = 2 * ps + (1 if ps == 1 else 0)
    assert m.prefix_len == want and list(m.pages) == pages[: want // ps]
    assert _path(tree, m.last_node)[0] == tuple(a[:want])  # split at the match's end
    assert tree.total_size() == 5 * ps
    # inserting b shares the common whole pages and adds the rest
    extra = _alloc_pages(tree, 5)
    assert tree.insert(RadixKey(b), extra) == want
    assert tree.total_size() == 5 * ps + (5 * ps - want)
    m = tree.match_prefix(RadixKey(b + [1] * ps))
    assert list(m.pages) == pages[: want // ps] + extra[want // ps : 5]


def test_extra_key_never_shares():
    tree = _cache(1)
    ids = [1, 2, 3, 4]
    tree.insert(RadixKey(ids, "lora-a"), _alloc_pages(tree, 4))
    assert tree.match_prefix(RadixKey(ids)).prefix_len == 0
    assert tree.match_prefix(RadixKey(ids, "lora-b")).prefix_len == 0
    assert tree.match_prefix(RadixKey(ids, "lora-a")).prefix_len == 4
    assert tree.insert(RadixKey(ids), _alloc_pages(tree, 4)) == 0  # its own node
    assert tree.total_size() == 8


def test_lock_protects_and_sizes_move():
    tree = _cache(2)
    tree.insert(RadixKey(range(8)), _alloc_pages(tree, 4))
    m = tree.match_prefix(RadixKey(range(4)))  # splits: [0..3] locked, [4..7] not
    assert tree.inc_lock_ref(m.last_node) == -4
    assert (tree.evictable_size(), tree.protected_size()) == (4, 4)
    assert tree.evict(100) == 4  # only the unlocked leaf
    assert tree.match_prefix(RadixKey(range(8))).prefix_len == 4
    assert tree.dec_lock_ref(m.last_node) == 4
    assert (tree.evictable_size(), tree.protected_size()) == (4, 0)
    with pytest.raises(RuntimeError, match="not locked"):
        tree.dec_lock_ref(m.last_node)
    assert tree.evict(1) == 4 and tree.total_size() == 0
    assert tree.token_to_kv_pool_allocator.available_size() == 64 * 2


def test_evict_is_lru():
    tree = _cache(1)
    for first in (10, 20, 30):
        tree.insert(RadixKey([first, 1, 2]), _alloc_pages(tree, 3))
    tree.match_prefix(RadixKey([10, 1]))  # 10's branch is now the most recent
    assert tree.evict(3) == 3
    assert tree.match_prefix(RadixKey([20, 1, 2])).prefix_len == 0
    assert tree.match_prefix(RadixKey([30, 1, 2])).prefix_len == 3
    assert tree.match_prefix(RadixKey([10, 1, 2])).prefix_len == 3


def test_bad_arguments_change_nothing():
    tree = _cache(4)
    with pytest.raises(TypeError, match="RadixKey"):
        tree.match_prefix([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="value has 1 pages"):
        tree.insert(RadixKey(range(8)), [5])
    with pytest.raises(ValueError, match="num_tokens"):
        tree.evict(-1)
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(None, None, 0)
    assert tree.total_size() == 0 and tree.evictable_size() == 0


def _req(rid: int, ids: list[int], extra_key: str | None = None) -> Req:
    return Req(rid, list(ids), SamplingParams(max_new_tokens=4), extra_key=extra_key)


@pytest.mark.parametrize("ps", [1, 4])
def test_cache_unfinished_req_switches_to_tree_pages(ps):
    """Two requests computed the same tokens: the second's chunk boundary frees its duplicate
    pages, points its req_to_token row at the tree's, and moves its lock to the longer path."""
    tree = _cache(ps)
    r2t = tree.req_to_token_pool
    ids = list(range(1, 3 * ps + 2))
    full = len(ids) // ps  # whole pages (all of them for page_size 1)
    reqs = []
    for rid in range(2):
        r = _req(rid, ids)
        r.req_pool_idx = r2t.alloc(1)[0]
        r.kv_pages = _alloc_pages(tree, 4)
        r.kv_len = len(ids)
        slots = tree._slots(r.kv_pages)[: len(ids)]
        r2t.req_to_token[r.req_pool_idx, : len(ids)] = slots.to(torch.int32)
        reqs.append(r)
    free0 = tree.token_to_kv_pool_allocator.available_size()
    tree.cache_unfinished_req(reqs[0])
    assert tree.token_to_kv_pool_allocator.available_size() == free0  # it owned all of it
    tree.cache_unfinished_req(reqs[1])
    assert tree.token_to_kv_pool_allocator.available_size() == free0 + full * ps  # dup pages
    a, b = reqs
    assert a.kv_pages[:full] == b.kv_pages[:full]
    assert ps == 1 or a.kv_pages[full] != b.kv_pages[full]  # each keeps its partial page
    assert a.cache_protected_len == b.cache_protected_len == full * ps
    row = r2t.req_to_token[b.req_pool_idx, : len(ids)].tolist()
    assert row == tree._slots(b.kv_pages)[: len(ids)].tolist()
    assert tree.protected_size() == full * ps and a.last_node is b.last_node
    for r in reqs:
        tree.cache_finished_req(r)
    assert tree.protected_size() == 0 and tree.evictable_size() == full * ps
    assert r2t.available_size() == 8


# ----------------------------------------------------------------------------- properties
class Sim:
    """Drives a RadixCache the way the scheduler does, with a fake KV store: each slot holds
    the id of the token sequence whose last token wrote it (0: never written)."""

    def __init__(self, ps: int, pages: int, rng: random.Random) -> None:
        self.tree = _cache(ps, pages, rows=6)
        self.ps, self.rng = ps, rng
        self.alloc = self.tree.token_to_kv_pool_allocator
        self.kv = [0] * ((pages + 1) * ps)
        self.ids: dict[tuple[int, ...], int] = {}  # token prefix -> its fake KV value
        self.running: list[Req] = []
        self.bases = [[rng.randrange(50) for _ in range(rng.randrange(1, 4 * ps + 6))]]
        self.next_rid = 0
        self.evicted_order_ok = True

    def value(self, tokens: tuple[int, ...]) -> int:
        return self.ids.setdefault(tokens, len(self.ids) + 1)

    def write(self, req: Req, start: int) -> None:
        """The forward pass: token p of the request writes its own slot, only past start."""
        toks = tuple(req.origin_input_ids + req.output_ids)
        own = set(req.kv_pages[req.cache_protected_len // self.ps :])
        for p in range(start, req.kv_len):
            slot = req.kv_pages[p // self.ps] * self.ps + p % self.ps
            assert slot // self.ps in own, "a write outside the request's own pages"
            self.kv[slot] = self.value(toks[: p + 1])

    def new(self) -> None:
        rng, ps = self.rng, self.ps
        if len(self.running) >= 5:
            return
        base = rng.choice(self.bases)
        ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(3)]
        ids = ids[: max(1, len(ids))]
        if rng.random() < 0.3:
            self.bases.append(list(ids))
        req = _req(self.next_rid, ids, rng.choice([None, None, "salt"]))
        self.next_rid += 1
        m = self.tree.match_prefix(RadixKey(ids[: len(ids) - 1], req.extra_key))
        self.tree.inc_lock_ref(m.last_node)
        need = len(ids) - m.prefix_len
        new_pages = -(-need // ps)
        if self.alloc.available_size() < new_pages * ps:
            self.tree.evict(new_pages * ps - self.alloc.available_size())
        if self.alloc.available_size() < new_pages * ps:
            self.tree.dec_lock_ref(m.last_node)
            return
        req.kv_pages, req.kv_len = list(m.pages), m.prefix_len
        req.cache_protected_len, req.last_node, req.cached_tokens = m.prefix_len, m.last_node, 0
        req.req_pool_idx = self.tree.req_to_token_pool.alloc(1)[0]
        last = req.kv_pages[-1] * ps + ps - 1 if req.kv_pages else -1
        got = self.alloc.alloc_extend(
            torch.tensor([m.prefix_len]), torch.tensor([len(ids)]), torch.tensor([last]), need
        )
        assert got is not None
        req.kv_pages += (got[::ps] // ps).tolist()
        req.kv_len = len(ids)
        self.write(req, m.prefix_len)
        self.running.append(req)

    def decode(self, req: Req) -> bool:
        ps = self.ps
        last = req.kv_pages[(req.kv_len - 1) // ps] * ps + (req.kv_len - 1) % ps
        if req.kv_len % ps == 0 and self.alloc.available_size() < ps:
            self.tree.evict(ps)
        got = self.alloc.alloc_decode(torch.tensor([req.kv_len + 1]), torch.tensor([last]))
        if got is None:
            return False
        req.output_ids.append(self.rng.randrange(50))
        if req.kv_len % ps == 0:
            req.kv_pages.append(int(got[0]) // ps)
        req.kv_len += 1
        self.write(req, req.kv_len - 1)
        return True

    def evict(self, n: int) -> None:
        before = {id(x): x.last_access for x in self.tree.nodes()}
        freed = self.tree.evict(n)
        after = {id(x) for x in self.tree.nodes()}
        gone = [t for i, t in before.items() if i not in after]
        leaves = self.tree._evictable_leaves
        if gone and leaves:  # everything evicted is older than every leaf kept
            assert max(gone) <= min(x.last_access for x in leaves)
        assert freed >= n or not leaves

    def check(self) -> None:
        tree, ps = self.tree, self.ps
        check_ownership(tree, self.alloc, self.running)
        for r in self.running:  # what the request reads is its own tokens' KV
            toks = tuple(r.origin_input_ids + r.output_ids)
            for p in range(r.kv_len):
                slot = r.kv_pages[p // ps] * ps + p % ps
                assert self.kv[slot] == self.value(toks[: p + 1]), "KV changed under it"
        for x in tree.nodes():  # every cached token's KV is still that of its prefix
            toks, pages = _path(tree, x)
            for p in range(len(toks)):
                slot = pages[p // ps] * ps + p % ps
                assert self.kv[slot] == self.value(toks[: p + 1]), "cached KV bytes changed"


ACTIONS = ["new", "new", "decode", "finish", "abort", "unfinished", "evict", "match"]


@settings(max_examples=60, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    pages=st.integers(4, 24),
    seed=st.integers(0, 2**31 - 1),
    actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=60),
)
def test_random_lifecycles_keep_every_invariant(ps, pages, seed, actions):
    sim = Sim(ps, pages, random.Random(seed))
    rng = sim.rng
    for act in actions:
        if act == "new":
            sim.new()
        elif act == "evict":
            sim.evict(rng.randrange(0, 3 * ps + 1))
        elif act == "match":
            base = rng.choice(sim.bases)
            m = sim.tree.match_prefix(RadixKey(base[: rng.randrange(len(base) + 1)]))
            toks, pages_ = _path(sim.tree, m.last_node)
            assert list(m.pages) == pages_ and m.prefix_len == len(toks)
        elif sim.running:
            req = rng.choice(sim.running)
            if act == "decode":
                sim.decode(req)
            elif act == "unfinished":
                sim.tree.cache_unfinished_req(req)
            else:
                sim.running.remove(req)
                sim.tree.cache_finished_req(req, is_insert=act == "finish")
                assert req.req_pool_idx is None and req.last_node is None and not req.kv_pages
        sim.check()
    for req in sim.running:  # everything released: the tree alone holds pages, all unlocked
        sim.tree.cache_finished_req(req)
    sim.running = []
    sim.check()
    assert sim.tree.protected_size() == 0
    sim.tree.evict(10**9)
    assert sim.alloc.available_size() == sim.alloc.size and sim.tree.total_size() == 0


@given(
    a=st.lists(st.integers(0, 2), max_size=70),
    b=st.lists(st.integers(0, 2), max_size=70),
    pos=st.integers(0, 70),
    ps=st.sampled_from([1, 4, 16]),
)
@settings(max_examples=300, deadline=None)
def test_common_len_equals_the_token_by_token_walk(a, b, pos, ps):
    """The slice bisection finds the same shared length as comparing token by token (small
    alphabets: long equal runs, a difference anywhere)."""
    tree = _cache(ps)
    pos = min(pos, len(b))
    n, i = min(len(a), len(b) - pos), 0
    while i < n and a[i] == b[pos + i]:
        i += 1
    assert tree._common_len(tuple(a), tuple(b), pos) == i // ps * ps


@pytest.mark.parametrize("seed", range(6))
def test_every_eviction_takes_the_least_recently_used_leaf(seed):
    """The kept heap gives the order a fresh sort of the evictable leaves would: random
    inserts, matches (touches), locks and unlocks between single-leaf evictions."""
    rng = random.Random(seed)
    tree = _cache(1, pages=400)
    locked: list[TreeNode] = []
    keys = [[rng.randrange(4) for _ in range(rng.randrange(1, 9))] for _ in range(40)]
    for _ in range(300):
        op = rng.random()
        key = RadixKey(rng.choice(keys))
        if op < 0.35 and tree.token_to_kv_pool_allocator.available_size() >= 8:
            assert tree.insert(key, _alloc_pages(tree, len(key.token_ids))) <= len(key.token_ids)
        elif op < 0.6:
            m = tree.match_prefix(key)
            if m.prefix_len and rng.random() < 0.3:
                tree.inc_lock_ref(m.last_node)
                locked.append(m.last_node)
        elif op < 0.7 and locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        elif tree._evictable_leaves:
            want = min(tree._evictable_leaves, key=lambda n: (n.last_access, n.id))
            assert tree.evict(1) == len(want.key)
            assert want not in tree._evictable_leaves and want.parent is not None
            assert want not in want.parent.children.values()

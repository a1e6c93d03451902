"""SWARadixCache over a hybrid pool (CPU, no model): the window match rule (a prefix longer than
the window matched, one whose window pages were tombstoned shortened), tombstones revived by
an insert, window locks per page surviving splits, and property tests of random request
lifecycles (through ScheduleBatch's allocation, window eviction and freeing) that keep every
invariant of both pools: each page held by exactly one of the free list, the tree and one
running request; sizes and locks exact; the full -> window mapping exact; every token's tag in
its full and window slot still that of its prefix; every match maximal under the rule."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixKey
from srt.mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from srt.mem_cache.swa_memory_pool import SWAKVPool
from srt.mem_cache.swa_radix_cache import SWARadixCache
from srt.sampling.sampling_params import SamplingParams
from tests.srt.mem_cache.radix_checks import path_of
from tests.srt.mem_cache.swa_radix_checks import check_swa_ownership, own_swa


def _tree(ps: int, pages: int = 32, swa_pages: int = 32, w: int = 4) -> SWARadixCache:
    pool = SWAKVPool(pages * ps, swa_pages * ps, ps, torch.float32, 1, 4, [0], [1], w, "cpu")
    alloc = SWATokenToKVPoolAllocator(pages * ps, swa_pages * ps, ps, "cpu", pool)
    return SWARadixCache(ReqToTokenPool(8, 256, "cpu", enable_swa=True), alloc, ps, w)


def _insert(tree: SWARadixCache, ids: list[int], live_from: int = 0) -> tuple[list, list]:
    """Allocate whole pages for ids and insert them, window pages only from token page
    live_from on (the earlier ones as if freed already)."""
    ps, alloc = tree.page_size, tree.token_to_kv_pool_allocator
    n = len(ids) // ps
    got = alloc.alloc_extend(
        torch.tensor([0]), torch.tensor([n * ps]), torch.tensor([-1]), n * ps,
        swa_last_loc=torch.tensor([-1]),
    )  # fmt: skip
    full, swa = (got.full[::ps] // ps).tolist(), (got.swa[::ps] // ps).tolist()
    dead = torch.tensor(swa[:live_from], dtype=torch.int64) * ps
    alloc.free_swa(dead, tree._slots(full[:live_from]) if live_from else dead)
    swa = [-1] * live_from + swa[live_from:]
    assert tree.insert(RadixKey(ids), full, swa) == 0
    return full, swa


@pytest.mark.parametrize("ps", [1, 4])
def test_match_rule_longer_than_the_window_and_shortened_by_tombstones(ps):
    tree, w = _tree(ps), 4
    ids = list(range(100, 100 + 10 * ps))
    full, swa = _insert(tree, ids, live_from=6)  # pages 0 .. 5 tombstoned
    # the whole key: its last W tokens' pages are live -> matched, far longer than W
    m = tree.match_prefix(RadixKey(ids + [1]))
    assert m.prefix_len == 10 * ps and list(m.pages) == full and list(m.swa_pages) == swa
    # a prefix ending inside the tombstones: shortened to... nothing (pages 0 .. 5 dead)
    m = tree.match_prefix(RadixKey(ids[: 6 * ps] + [1]))
    assert m.prefix_len == 0 and m.last_node is tree.root_node
    # ending at page 7: usable iff its last W tokens lie in live pages (page 4: tokens 24 ..
    # 27 in page 6; page 1: tokens 3 .. 6, pages 3 .. 5 dead -> nothing usable)
    m = tree.match_prefix(RadixKey(ids[: 7 * ps] + [1]))
    lo = max(0, 7 * ps - w) // ps
    assert m.prefix_len == (7 * ps if lo >= 6 else 0)
    alloc = tree.token_to_kv_pool_allocator
    check_swa_ownership(tree, alloc, [])
    assert tree.swa_evictable_size() == 4 * ps and tree.evictable_size() == 10 * ps
    # the same tokens again, every window page live: the tombstones are revived with the
    # caller's pages, the rest of its copies are freed
    n = 10 * ps
    got = alloc.alloc_extend(
        torch.tensor([0]), torch.tensor([n]), torch.tensor([-1]), n, swa_last_loc=torch.tensor([-1])
    )
    full2, swa2 = (got.full[::ps] // ps).tolist(), (got.swa[::ps] // ps).tolist()
    matched, taken = tree._insert(RadixKey(ids), full2, swa2)
    assert matched == n and taken == [True] * 6 + [False] * 4
    tree._release(full2, swa2, taken, range(10))
    check_swa_ownership(tree, alloc, [])
    assert tree.swa_evictable_size() == n and alloc.swa_available_size() == alloc.size_swa - n
    assert tree.match_prefix(RadixKey(ids[: 6 * ps] + [1])).prefix_len == 6 * ps


@pytest.mark.parametrize("ps", [1, 2])
def test_window_locks_survive_splits_and_block_tombstones(ps):
    tree = _tree(ps)
    ids = list(range(7, 7 + 8 * ps))
    _insert(tree, ids)
    m = tree.match_prefix(RadixKey(ids + [0]))
    tree.inc_lock_ref(m.last_node)
    lo, hi = tree.window_pages(8 * ps)
    assert tree.swa_protected_size() == (hi - lo) * ps
    tree.match_prefix(RadixKey(ids[: 7 * ps] + [0]))  # splits the locked node
    freed = tree.evict_swa(10**6)  # every unlocked window page; the locked ones stay
    assert freed == lo * ps and tree.swa_evictable_size() == 0
    m2 = tree.match_prefix(RadixKey(ids + [0]))
    assert m2.prefix_len == 8 * ps  # its window is locked, so still live
    tree.dec_lock_ref(m.last_node)
    assert tree.swa_protected_size() == 0 and tree.swa_evictable_size() == (hi - lo) * ps
    with pytest.raises(RuntimeError, match="not locked"):
        tree.dec_lock_ref(m.last_node)
    assert tree.swa_protected_size() == 0 and tree.protected_size() == 0
    assert tree.evict(10**6) == 8 * ps  # leaves go with their window pages
    alloc = tree.token_to_kv_pool_allocator
    assert alloc.available_size() == alloc.size and alloc.swa_available_size() == alloc.size_swa
    assert (tree.kv_pool.full_to_swa_index_mapping[ps:] == -1).all()


def test_constructor_checks():
    tree = _tree(1)
    with pytest.raises(ValueError, match="sliding_window_size"):
        SWARadixCache(tree.req_to_token_pool, tree.token_to_kv_pool_allocator, 1, 0)
    with pytest.raises(TypeError, match="SWATokenToKVPoolAllocator"):
        SWARadixCache(tree.req_to_token_pool, object(), 1, 4)


# ----------------------------------------------------------------------------- property test
class Sim:
    """Requests through ScheduleBatch over a small hybrid pool, with a tag per token (its
    prefix) written into its full and window slots, as a forward pass would."""

    def __init__(self, ps: int, pages: int, swa_pages: int, w: int, rng: random.Random) -> None:
        self.ps, self.w, self.rng = ps, w, rng
        self.tree = _tree(ps, pages, swa_pages, w)
        self.alloc = self.tree.token_to_kv_pool_allocator
        self.batch = ScheduleBatch(
            self.tree.req_to_token_pool, self.alloc, self.tree.kv_pool, None, ps, "cpu", False
        )
        self.batch.tree_cache = self.tree
        self.full_kv: dict[int, tuple] = {}
        self.swa_kv: dict[int, tuple] = {}
        self.running: list[Req] = []
        self.bases = [[rng.randrange(20) for _ in range(n)] for n in (ps, 3 * ps, 2 * ps + 5, 9)]
        self.rid = 0

    def write(self, r: Req, first: int) -> None:
        """Tag tokens first .. kv_len - 1 in their slots (what a forward writes)."""
        toks, ps = tuple(r.origin_input_ids + r.output_ids), self.ps
        swa = self.tree.kv_pool.full_to_swa_index_mapping
        for p in range(first, r.kv_len):
            slot = r.kv_pages[p // ps] * ps + p % ps
            self.full_kv[slot] = toks[: p + 1]
            self.swa_kv[int(swa[slot])] = toks[: p + 1]

    def room(self, full: int, swa: int) -> bool:
        a, t = self.alloc, self.tree
        if a.available_size() < full:
            t.evict(full - a.available_size())
        return a.available_size() >= full and a.swa_available_size() + t.swa_evictable_size() >= swa

    def new(self) -> None:
        rng, ps = self.rng, self.ps
        if len(self.running) >= 4:
            return
        base = rng.choice(self.bases)
        ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(20) for _ in range(3)]
        if rng.random() < 0.3:
            self.bases.append(list(ids))
        r = Req(self.rid, ids, SamplingParams(max_new_tokens=64))
        self.rid += 1
        m = self.tree.match_prefix(RadixKey(tuple(ids[:-1])))
        self.tree.inc_lock_ref(m.last_node)
        pages = -(-(len(ids) - m.prefix_len) // ps) * ps
        if not self.room(pages, pages):
            self.tree.dec_lock_ref(m.last_node)
            return
        lo, _ = self.tree.window_pages(m.prefix_len)
        r.kv_pages, r.kv_len = list(m.pages), m.prefix_len
        r.cache_protected_len, r.last_node = m.prefix_len, m.last_node
        r.swa_page_start, r.swa_pages = lo, list(m.swa_pages[lo:])
        self.batch.prepare_for_extend([r])
        self.write(r, m.prefix_len)
        r.output_ids.append(rng.randrange(20))
        self.running.append(r)
        if rng.random() < 0.7:  # the scheduler's insert after a prefill
            self.tree.cache_unfinished_req(r)

    def decode(self, r: Req) -> None:
        if not self.room(self.ps, self.ps):
            return
        self.batch.prepare_for_decode([r])
        self.write(r, r.kv_len - 1)
        r.output_ids.append(self.rng.randrange(20))

    def check_match(self) -> None:
        """A random key's match obeys the rule and is maximal."""
        base = self.rng.choice(self.bases)
        key = RadixKey(tuple(base[: self.rng.randrange(len(base) + 1)]))
        m = self.tree.match_prefix(key)
        toks, pages = path_of(self.tree, m.last_node)
        assert list(m.pages) == pages and m.prefix_len == len(toks)
        ps = self.ps
        swa = list(m.swa_pages)
        lo, hi = self.tree.window_pages(m.prefix_len)
        assert all(s >= 0 for s in swa[lo:hi])
        full = self.tree._path_pages(key.page_aligned(ps))[1]  # the full match's window pages
        for k in range(len(swa) + 1, len(full) + 1):
            lo, hi = self.tree.window_pages(k * ps)
            assert any(s < 0 for s in full[lo:hi]), "a longer prefix was usable"

    def check(self) -> None:
        check_swa_ownership(self.tree, self.alloc, self.running)
        ps = self.ps
        for r in self.running:  # what each request reads is its own tokens' K/V
            toks = tuple(r.origin_input_ids + r.output_ids)
            for p in range(r.kv_len):
                assert self.full_kv[r.kv_pages[p // ps] * ps + p % ps] == toks[: p + 1]
            for k, s in enumerate(r.swa_pages):
                for o in range(min(ps, r.kv_len - (r.swa_page_start + k) * ps)):
                    p = (r.swa_page_start + k) * ps + o
                    assert self.swa_kv[s * ps + o] == toks[: p + 1], "window K/V changed"
            assert set(own_swa(r, ps)) <= set(range(len(r.kv_pages)))
        for x in self.tree.nodes():  # every cached token's K/V, in both pools
            toks, pages = path_of(self.tree, x)
            swa = [s for y in _nodes(self.tree, x) for s in y.swa_value]
            for p in range(len(toks)):
                assert self.full_kv[pages[p // ps] * ps + p % ps] == toks[: p + 1]
                if swa[p // ps] >= 0:
                    assert self.swa_kv[swa[p // ps] * ps + p % ps] == toks[: p + 1]


def _nodes(tree: SWARadixCache, node) -> list:
    out = []
    while node is not tree.root_node:
        out.append(node)
        node = node.parent
    return out[::-1]


ACTIONS = ["new", "new", "decode", "decode", "trim", "finish", "abort", "unfinished"]
ACTIONS += ["evict", "evict_swa", "match"]


@settings(max_examples=80, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    w=st.integers(1, 6),
    pages=st.integers(8, 24),
    swa_pages=st.integers(8, 16),
    seed=st.integers(0, 2**31 - 1),
    actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=80),
)
def test_random_lifecycles_keep_both_pools_exact(ps, w, pages, swa_pages, seed, actions):
    _run(Sim(ps, pages, swa_pages, w, random.Random(seed)), actions)


def test_long_random_lifecycles_keep_both_pools_exact():
    """Longer runs than hypothesis draws (fresh seeds): requests that decode, give back their
    window pages and are inserted again mid-flight, under both pools' pressure."""
    for _ in range(40):
        seed = random.randrange(2**32)
        rng = random.Random(seed)
        ps, w = rng.choice([1, 2, 4]), rng.randrange(1, 7)
        sim = Sim(ps, rng.randrange(8, 24), rng.randrange(8, 16), w, rng)
        try:
            _run(sim, [rng.choice(ACTIONS) for _ in range(100)])
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e


def _run(sim: Sim, actions: list[str]) -> None:
    rng, tree, ps = sim.rng, sim.tree, sim.ps
    for act in actions:
        if act == "new":
            sim.new()
        elif act == "evict":
            tree.evict(rng.randrange(0, 3 * ps + 1))
        elif act == "evict_swa":
            tree.evict_swa(rng.randrange(0, 3 * ps + 1))
        elif act == "match":
            sim.check_match()
        elif act == "trim":
            sim.batch.evict_swa(sim.running)
        elif sim.running:
            r = rng.choice(sim.running)
            if act == "decode":
                sim.decode(r)
            elif act == "unfinished":
                tree.cache_unfinished_req(r)
            else:
                sim.running.remove(r)
                if act == "finish":
                    tree.cache_finished_req(r)
                else:
                    sim.batch.free_req(r)
                assert r.req_pool_idx is None and r.last_node is None and not r.swa_pages
        sim.check()
    for r in sim.running:
        tree.cache_finished_req(r)
    sim.running = []
    sim.check()
    assert tree.protected_size() == tree.swa_protected_size() == 0
    tree.evict(10**9)
    a = sim.alloc
    assert a.available_size() == a.size and a.swa_available_size() == a.size_swa
    assert (tree.kv_pool.full_to_swa_index_mapping[ps:] == -1).all()

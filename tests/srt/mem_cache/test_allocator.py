"""Token and paged KV-slot allocators: property tests of random request lifecycles with bad
operations mixed in (double frees, stray frees, wrong last_loc), issue-21 regressions, edges."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def _state(a: PagedTokenToKVPoolAllocator) -> tuple[list[int], list[bool], int]:
    return a.free_pages.tolist(), a._live.tolist(), a.available_size()


class Sim:
    """Drives an allocator like a scheduler does and keeps each request's slots."""

    def __init__(self, alloc: PagedTokenToKVPoolAllocator) -> None:
        self.a = alloc
        self.reqs: dict[int, list[int]] = {}  # request id -> slot of each token
        self.next_id = 0

    def extend(self, rids: list[int], new_lens: list[int]) -> bool:
        prefix = [len(self.reqs.get(r, [])) for r in rids]
        seq = [p + n for p, n in zip(prefix, new_lens, strict=True)]
        last = [self.reqs[r][-1] if self.reqs.get(r) else -1 for r in rids]
        before = _state(self.a)
        out = self.a.alloc_extend(_t(prefix), _t(seq), _t(last), sum(new_lens))
        if out is None:
            assert _state(self.a) == before  # a failed alloc changes nothing
            return False
        assert out.dtype == torch.int64 and out.shape == (sum(new_lens),)
        assert out.device.type == "cpu"  # host bookkeeping: no device read to record slots
        out = out.tolist()
        for r, n in zip(rids, new_lens, strict=True):
            self.reqs.setdefault(r, []).extend(out[:n])
            out = out[n:]
        return True

    def decode(self, rids: list[int]) -> bool:
        seq = [len(self.reqs[r]) + 1 for r in rids]
        last = [self.reqs[r][-1] if self.reqs[r] else -1 for r in rids]
        before = _state(self.a)
        out = self.a.alloc_decode(_t(seq), _t(last))
        if out is None:
            assert _state(self.a) == before
            return False
        for r, s in zip(rids, out.tolist(), strict=True):
            self.reqs[r].append(s)
        return True

    def finish(self, rid: int) -> None:
        self.a.free(_t(self.reqs.pop(rid)))

    def held_pages(self) -> set[int]:
        return {s // self.a.page_size for slots in self.reqs.values() for s in slots}

    def rejected(self, call, match: str) -> None:
        """The call raises ValueError and leaves the allocator exactly as it was."""
        before = _state(self.a)
        with pytest.raises(ValueError, match=match):
            call()
        assert _state(self.a) == before

    def rejected_type(self, call) -> None:
        """The call raises TypeError and leaves the allocator exactly as it was."""
        before = _state(self.a)
        with pytest.raises(TypeError):
            call()
        assert _state(self.a) == before

    def check(self) -> None:
        ps, a = self.a.page_size, self.a
        held_pages: set[int] = set()
        all_slots: list[int] = []
        for slots in self.reqs.values():
            all_slots += slots
            for i, s in enumerate(slots):
                assert s // ps != 0, "handed out the padding page"
                assert ps <= s < a.size + ps
                assert s % ps == i % ps, "token not at its offset within the page"
                if i % ps:
                    assert s == slots[i - 1] + 1, "a page is not filled contiguously"
            pages = {s // ps for s in slots}
            assert not pages & held_pages, "two requests share a page"
            held_pages |= pages
        assert len(set(all_slots)) == len(all_slots), "slot handed out twice"
        free = a.free_pages.tolist()
        assert len(set(free)) == len(free), "page twice in the free list"
        assert 0 not in free
        assert not set(free) & held_pages, "a held page is also free"
        assert len(free) + len(held_pages) == a.num_pages, "leaked pages"
        assert a.available_size() == len(free) * ps
        live = {p for p, x in enumerate(a._live.tolist()) if x}
        assert live == held_pages, "the live bitmap disagrees with what requests hold"


def _bad_op(sim: Sim, kind: int, data: st.DataObject) -> None:
    """One operation the allocator must reject without changing its state."""
    a, ps = sim.a, sim.a.page_size
    end = (a.num_pages + 1) * ps  # first slot past the pool
    free_pages = sorted(set(range(1, a.num_pages + 1)) - sim.held_pages())
    live = sorted(r for r in sim.reqs if sim.reqs[r])
    if kind == 0:  # out of range, or the padding page
        slot = data.draw(st.sampled_from([-1, -ps - 3, 0, ps - 1, end, end + 5]))
        sim.rejected(lambda: a.free(_t([slot])), f"slot {slot} ")
    elif kind == 1 and free_pages:  # double free / never handed out: a slot of a free page
        page = data.draw(st.sampled_from(free_pages))
        slot = page * ps + data.draw(st.integers(0, ps - 1))
        others = [s for r in live for s in sim.reqs[r]][:3]  # valid slots in the same call
        sim.rejected(lambda: a.free(_t([*others, slot])), f"slot {slot} .*not allocated")
    elif kind == 2 and live:  # the same slot twice in one call
        slots = sim.reqs[data.draw(st.sampled_from(live))]
        s = data.draw(st.sampled_from(slots))
        sim.rejected(lambda: a.free(_t([*slots, s])), f"slot {s} listed twice")
    elif kind == 5 and len(live) >= 2 and any(len(sim.reqs[r]) % ps for r in live):
        # two requests name one page with a free rest: a repeated last_loc (a full page may be
        # named by many: a shared prefix)
        r = data.draw(st.sampled_from([r for r in live if len(sim.reqs[r]) % ps]))
        o = data.draw(st.sampled_from([x for x in live if x != r]))
        n, last = len(sim.reqs[r]), sim.reqs[r][-1]
        # request o names r's last slot (at o's length: may be the wrong offset), or r twice
        m, match = (len(sim.reqs[o]), "last_loc") if data.draw(st.booleans()) else (n, "same page")
        if data.draw(st.booleans()):
            call = lambda: a.alloc_decode(_t([n + 1, m + 1]), _t([last, last]))
        else:
            call = lambda: a.alloc_extend(_t([n, m]), _t([n + 1, m + 2]), _t([last, last]), 3)
        sim.rejected(call, match)
    elif kind == 6:  # a float count (takes nothing, then raises: the old leak)
        sim.rejected_type(lambda: a.alloc_extend(_t([0]), _t([2]), _t([-1]), 2.0))
    elif kind in (3, 4) and live:  # wrong last_loc for a request that has tokens
        r = data.draw(st.sampled_from(live))
        n = len(sim.reqs[r])
        good = sim.reqs[r][-1]
        bad = [-1, 0, good + 1 if (good + 1) % ps else good - 1 if ps > 1 else -1]
        bad += [p * ps + (n - 1) % ps for p in free_pages[:1]]  # right offset, page not held
        b = data.draw(st.sampled_from(bad))
        if kind == 3:
            sim.rejected(lambda: a.alloc_extend(_t([n]), _t([n + 2]), _t([b]), 2), "last_loc")
        else:
            sim.rejected(lambda: a.alloc_decode(_t([n + 1]), _t([b])), "last_loc")


ops = st.lists(
    st.tuples(st.sampled_from(["new", "extend", "decode", "finish", "bad"]), st.integers(0, 2**16)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=80, deadline=None)
@given(page_size=st.sampled_from([1, 2, 16]), num_pages=st.integers(1, 9), ops=ops, data=st.data())
def test_random_lifecycles_never_leak_share_or_accept_bad_calls(page_size, num_pages, ops, data):
    sim = Sim(PagedTokenToKVPoolAllocator(page_size * num_pages, page_size, "cpu"))
    for op, seed in ops:
        live = sorted(sim.reqs)
        if op == "new" or not live:
            k = 1 + seed % 3
            rids = list(range(sim.next_id, sim.next_id + k))
            lens = data.draw(st.lists(st.integers(0, 3 * page_size + 1), min_size=k, max_size=k))
            if sim.extend(rids, lens):
                sim.next_id += k
        elif op == "extend":
            rids = live[seed % len(live) :][:2]
            lens = data.draw(
                st.lists(st.integers(0, 2 * page_size), min_size=len(rids), max_size=len(rids))
            )
            sim.extend(rids, lens)
        elif op == "decode":
            sim.decode(live[: 1 + seed % len(live)])
        elif op == "finish":
            sim.finish(live[seed % len(live)])
        else:
            _bad_op(sim, seed % 7, data)
        sim.check()
    for r in list(sim.reqs):
        sim.finish(r)
    sim.check()
    assert sim.a.available_size() == page_size * num_pages


# ----------------------------------------------------------------------------- issue 21
def test_issue21_item4_double_and_stray_frees_raise():
    a = TokenToKVPoolAllocator(8, "cpu")
    x = a.alloc(2)
    assert x is not None and x.tolist() == [1, 2]
    a.free(x)
    with pytest.raises(ValueError, match="slot 1 .*not allocated"):
        a.free(x)
    assert a.available_size() == 8
    with pytest.raises(ValueError, match="slot -1 .*outside"):
        a.free(torch.tensor([-1]))
    with pytest.raises(ValueError, match="slot 100 .*outside"):
        a.free(torch.tensor([100]))
    assert a.available_size() == 8
    got = a.alloc(8)
    assert got is not None and sorted(got.tolist()) == list(range(1, 9))  # each slot once
    assert a.alloc(1) is None


def test_issue21_item5_last_loc_is_checked():
    a = PagedTokenToKVPoolAllocator(64, 16, "cpu")
    with pytest.raises(ValueError, match="last_loc: slot -1"):
        a.alloc_extend(_t([5]), _t([8]), _t([-1]), 3)
    with pytest.raises(ValueError, match="last_loc: slot -1"):
        a.alloc_decode(_t([2]), _t([-1]))
    with pytest.raises(ValueError, match="last_loc: slot 3 .*outside"):
        a.alloc_decode(_t([4]), _t([3]))  # a padding-page slot
    assert a.available_size() == 64
    with pytest.raises(ValueError, match="last_loc: slot 20 .*not allocated"):
        a.alloc_decode(_t([5]), _t([20]))  # right offset, page 1 never handed out
    first = a.alloc_extend(_t([0]), _t([5]), _t([-1]), 5)
    assert first is not None and first.tolist() == [16, 17, 18, 19, 20]
    with pytest.raises(ValueError, match=r"last_loc\[0\] = 19 is at page offset 3"):
        a.alloc_decode(_t([6]), _t([19]))  # allocated, but not the request's last token
    assert a.alloc_decode(_t([6]), _t([20])).tolist() == [21]
    assert a.available_size() == 48


# ----------------------------------------------------------------------------- issue 50
@pytest.mark.parametrize("page_size", [3, 4])
def test_issue50_repeated_last_loc_is_rejected(page_size):
    """Two requests naming one page that is not full (one slot twice, or two slots of one
    page) would fill its free rest with each other's tokens: rejected, nothing taken."""
    ps = page_size
    a = PagedTokenToKVPoolAllocator(16 * ps, ps, "cpu")
    x = a.alloc_extend(_t([0, 0]), _t([2, 2]), _t([-1, -1]), 4)  # two requests of 2 tokens
    assert x is not None
    s0, s1 = int(x[1]), int(x[3])  # each request's last slot
    before = _state(a)
    with pytest.raises(ValueError, match=r"last_loc\[0\] = .* and last_loc\[2\] .*same page"):
        a.alloc_decode(_t([3, 3, 3, 3]), _t([s0, s1, s0, s1]))
    with pytest.raises(ValueError, match="same page"):
        a.alloc_extend(_t([2, 2]), _t([3, 4]), _t([s0, s0]), 3)
    assert _state(a) == before
    if ps > 1:  # slots 5 and 6 of one page: the old code gave request 0 slot 6, request 1's
        b = PagedTokenToKVPoolAllocator(16, 4, "cpu")
        assert b.alloc_extend(_t([0]), _t([3]), _t([-1]), 3).tolist() == [4, 5, 6]
        with pytest.raises(ValueError, match=r"last_loc\[0\] = 5 and last_loc\[1\] = 6"):
            b.alloc_decode(_t([3, 4]), _t([5, 6]))
    got = a.alloc_decode(_t([3, 3]), _t([s0, s1]))  # each its own: fine
    assert got is not None and len(set(got.tolist())) == 2


@pytest.mark.parametrize("page_size", [1, 4])
def test_full_last_page_may_be_shared(page_size):
    """A prefix shared through the radix cache: requests naming the last slot of one full page
    each get fresh pages (nothing is written into the shared one); a page with a free rest
    named twice is still refused, nothing taken."""
    ps = page_size
    a = PagedTokenToKVPoolAllocator(16 * ps, ps, "cpu")
    shared = a.alloc(2 * ps)  # a two-page prefix
    assert shared is not None
    last = int(shared[-1])
    seq = [2 * ps + 1, 2 * ps + 3, 3 * ps]
    got = a.alloc_extend(_t([2 * ps] * 3), _t(seq), _t([last] * 3), 4 + ps)
    assert got is not None and len(set((got // ps).tolist()) & set((shared // ps).tolist())) == 0
    assert len({int(s) // ps for s in got}) == 3 + 2 * (ps == 1)  # fresh pages of their own
    dec = a.alloc_decode(_t([2 * ps + 1] * 2), _t([last] * 2))
    assert dec is not None and not set((dec // ps).tolist()) & set((shared // ps).tolist())
    if ps > 1:
        before = _state(a)
        with pytest.raises(ValueError, match="same page"):
            a.alloc_decode(_t([2 * ps, 2 * ps]), _t([last - 1, last - 1]))
        assert _state(a) == before


def test_issue50_float_count_takes_nothing():
    a = PagedTokenToKVPoolAllocator(8, 2, "cpu")
    for bad in (3.0, True, torch.tensor(3)):
        with pytest.raises(TypeError, match="extend_num_tokens must be an int"):
            a.alloc_extend(_t([0]), _t([3]), _t([-1]), bad)
        assert a.available_size() == 8 and not a._live.any()
    assert a.alloc(8) is not None  # every page is still there


# ----------------------------------------------------------------------------- edges
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_edge_cases_seq_len_zero_and_page_multiples(page_size):
    ps = page_size
    a = PagedTokenToKVPoolAllocator(8 * ps, ps, "cpu")
    sim = Sim(a)
    assert sim.extend([0, 1], [0, 0])  # seq_len 0: nothing allocated
    assert sim.reqs == {0: [], 1: []} and a.available_size() == 8 * ps
    assert sim.extend([0], [2 * ps])  # exactly two pages
    assert a.available_size() == 6 * ps
    assert sim.extend([0], [ps])  # prefix is an exact page multiple: a fresh page, no fill
    assert sim.reqs[0][2 * ps] % ps == 0 and a.available_size() == 5 * ps
    assert sim.decode([0])  # starts a page again (length 3*ps + 1)
    assert a.available_size() == 4 * ps
    sim.check()
    sim.finish(0)
    sim.finish(1)  # a request with no tokens frees nothing
    assert a.available_size() == 8 * ps


def test_partial_last_page_is_filled_before_new_pages():
    a = PagedTokenToKVPoolAllocator(16, 4, "cpu")
    first = a.alloc_extend(_t([0]), _t([3]), _t([-1]), 3)
    assert first is not None and first.tolist() == [4, 5, 6]
    out = a.alloc_extend(_t([3]), _t([9]), _t([6]), 6)
    assert out is not None and out.tolist() == [7, 8, 9, 10, 11, 12]
    dec = a.alloc_decode(_t([10]), _t([12]))
    assert dec is not None and dec.tolist() == [13]
    assert a.available_size() == 4


def test_out_of_memory_returns_none_and_changes_nothing():
    a = PagedTokenToKVPoolAllocator(8, 4, "cpu")
    assert a.alloc_extend(_t([0]), _t([9]), _t([-1]), 9) is None
    assert a.available_size() == 8
    assert a.alloc(12) is None and a.available_size() == 8
    got = a.alloc(8)
    assert got is not None and sorted(got.tolist()) == list(range(4, 12))
    assert a.alloc_decode(_t([1]), _t([-1])) is None


def test_token_allocator_never_hands_out_or_takes_back_slot_zero():
    a = TokenToKVPoolAllocator(7, "cpu")
    got = a.alloc(7)
    assert got is not None and sorted(got.tolist()) == list(range(1, 8))
    assert a.alloc(1) is None
    a.free(got[:3])
    with pytest.raises(ValueError, match="slot 0 "):
        a.free(torch.tensor([0]))  # the padding slot was never handed out
    assert a.available_size() == 3 and 0 not in a.free_pages.tolist()
    a.free(got[3:].to(torch.int32))  # int32 indices too
    assert a.available_size() == 7
    assert sorted(a.alloc(7).tolist()) == list(range(1, 8))  # freed slots come back once each
    a.clear()
    assert a.available_size() == 7


def test_paged_free_of_any_slot_frees_its_whole_page():
    a = PagedTokenToKVPoolAllocator(12, 4, "cpu")
    got = a.alloc(8)  # pages 1, 2
    a.free(got[[1, 2, 5]])  # slots of page 1 (twice) and page 2: each page once
    assert a.available_size() == 12
    with pytest.raises(ValueError, match="slot 4 .*not allocated"):
        a.free(got[:1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple of page_size"):
        PagedTokenToKVPoolAllocator(10, 4, "cpu")
    with pytest.raises(ValueError, match="kvcache"):
        TokenToKVPoolAllocator(4, "cpu", scrub_on_alloc=True)
    a = PagedTokenToKVPoolAllocator(8, 2, "cpu")
    with pytest.raises(ValueError, match="extend_num_tokens"):
        a.alloc_extend(_t([0]), _t([3]), _t([-1]), 2)
    with pytest.raises(ValueError, match="seq_lens >= prefix_lens"):
        a.alloc_extend(_t([3]), _t([1]), _t([5]), -2)
    with pytest.raises(ValueError, match="same shape"):
        a.alloc_extend(_t([0, 0]), _t([1]), _t([-1]), 1)
    with pytest.raises(TypeError, match="seq_lens"):
        a.alloc_decode(torch.tensor([1.0]), _t([-1]))
    with pytest.raises(TypeError, match="free_index"):
        a.free([2, 3])
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(True)
    assert a.available_size() == 8


def test_scrub_on_alloc_zeroes_whole_new_pages():
    class FakePool:
        def __init__(self):
            self.zeroed: list[int] = []

        def zero_slots(self, idx: torch.Tensor) -> None:
            self.zeroed += idx.tolist()

    pool = FakePool()
    a = PagedTokenToKVPoolAllocator(12, 3, "cpu", kvcache=pool, scrub_on_alloc=True)
    out = a.alloc_extend(_t([0]), _t([4]), _t([-1]), 4)
    assert out is not None
    assert sorted(pool.zeroed) == [3, 4, 5, 6, 7, 8]  # both new pages, all slots
    pool.zeroed.clear()
    a.alloc_decode(_t([5]), out[-1:])  # same page: nothing new to scrub
    assert pool.zeroed == []


@needs_cuda
def test_paged_allocator_for_cuda_takes_device_indices_and_matches_cpu():
    """Device index tensors are accepted (copied to the host); results are host tensors."""
    cpu = PagedTokenToKVPoolAllocator(64, 4, "cpu")
    gpu = PagedTokenToKVPoolAllocator(64, 4, "cuda")
    args = (_t([0, 3, 0]), _t([5, 9, 0]), _t([-1, -1, -1]), 11)
    with pytest.raises(ValueError, match="last_loc"):  # request 1 has a prefix but no slot
        gpu.alloc_extend(*(x.cuda() if isinstance(x, torch.Tensor) else x for x in args))
    args = (_t([0, 0]), _t([5, 9]), _t([-1, -1]), 14)
    out_c = cpu.alloc_extend(*args)
    out_g = gpu.alloc_extend(*(x.cuda() if isinstance(x, torch.Tensor) else x for x in args))
    assert out_g is not None and out_g.device.type == "cpu" and torch.equal(out_g, out_c)
    dec = (_t([6, 10]), out_c[[4, 13]])
    assert torch.equal(gpu.alloc_decode(*(d.cuda() for d in dec)), cpu.alloc_decode(*dec))
    gpu.free(out_g.cuda())
    cpu.free(out_c)
    assert gpu.available_size() == cpu.available_size() == 64

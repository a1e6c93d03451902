"""Token and paged KV-slot allocators: property tests of random request lifecycles + edge cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


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
        state = self.a.backup_state()
        out = self.a.alloc_extend(
            torch.tensor(prefix), torch.tensor(seq), torch.tensor(last), sum(new_lens)
        )
        if out is None:
            assert torch.equal(self.a.free_pages, state)  # a failed alloc changes nothing
            return False
        assert out.dtype == torch.int64 and out.shape == (sum(new_lens),)
        out = out.tolist()
        for r, n in zip(rids, new_lens, strict=True):
            self.reqs.setdefault(r, []).extend(out[:n])
            out = out[n:]
        return True

    def decode(self, rids: list[int]) -> bool:
        seq = [len(self.reqs[r]) + 1 for r in rids]
        last = [self.reqs[r][-1] if self.reqs[r] else -1 for r in rids]
        state = self.a.backup_state()
        out = self.a.alloc_decode(torch.tensor(seq), torch.tensor(last))
        if out is None:
            assert torch.equal(self.a.free_pages, state)
            return False
        for r, s in zip(rids, out.tolist(), strict=True):
            self.reqs[r].append(s)
        return True

    def finish(self, rid: int) -> None:
        self.a.free(torch.tensor(self.reqs.pop(rid), dtype=torch.int64))

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


ops = st.lists(
    st.tuples(st.sampled_from(["new", "extend", "decode", "finish"]), st.integers(0, 2**16)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4, 7]), num_pages=st.integers(1, 9), ops=ops, data=st.data()
)
def test_random_request_lifecycles_never_leak_or_share(page_size, num_pages, ops, data):
    sim = Sim(PagedTokenToKVPoolAllocator(page_size * num_pages, page_size, "cpu", debug_mode=True))
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
        else:
            sim.finish(live[seed % len(live)])
        sim.check()
    for r in list(sim.reqs):
        sim.finish(r)
    sim.check()
    assert sim.a.available_size() == page_size * num_pages


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
    first = a.alloc_extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]), 3)
    assert first is not None and first.tolist() == [4, 5, 6]
    out = a.alloc_extend(torch.tensor([3]), torch.tensor([9]), torch.tensor([6]), 6)
    assert out is not None and out.tolist() == [7, 8, 9, 10, 11, 12]
    dec = a.alloc_decode(torch.tensor([10]), torch.tensor([12]))
    assert dec is not None and dec.tolist() == [13]
    assert a.available_size() == 4


def test_out_of_memory_returns_none_and_changes_nothing():
    a = PagedTokenToKVPoolAllocator(8, 4, "cpu")
    assert a.alloc_extend(torch.tensor([0]), torch.tensor([9]), torch.tensor([-1]), 9) is None
    assert a.available_size() == 8
    assert a.alloc(12) is None and a.available_size() == 8
    got = a.alloc(8)
    assert got is not None and sorted(got.tolist()) == list(range(4, 12))
    assert a.alloc_decode(torch.tensor([1]), torch.tensor([-1])) is None


def test_token_allocator_never_hands_out_slot_zero():
    a = TokenToKVPoolAllocator(7, "cpu", debug_mode=True)
    got = a.alloc(7)
    assert got is not None and sorted(got.tolist()) == list(range(1, 8))
    assert a.alloc(1) is None
    a.free(got[:3])
    a.free(torch.tensor([0]))  # the padding slot is never returned to the free list
    assert a.available_size() == 3 and 0 not in a.free_pages.tolist()
    a.clear()
    assert a.available_size() == 7


def test_bad_arguments_and_double_free():
    with pytest.raises(ValueError, match="multiple of page_size"):
        PagedTokenToKVPoolAllocator(10, 4, "cpu")
    with pytest.raises(ValueError, match="kvcache"):
        TokenToKVPoolAllocator(4, "cpu", scrub_on_alloc=True)
    a = PagedTokenToKVPoolAllocator(8, 2, "cpu", debug_mode=True)
    with pytest.raises(ValueError, match="extend_num_tokens"):
        a.alloc_extend(torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]), 2)
    with pytest.raises(ValueError, match="seq_lens >= prefix_lens"):
        a.alloc_extend(torch.tensor([3]), torch.tensor([1]), torch.tensor([5]), -2)
    with pytest.raises(ValueError, match="same shape"):
        a.alloc_extend(torch.tensor([0, 0]), torch.tensor([1]), torch.tensor([-1]), 1)
    with pytest.raises(TypeError, match="seq_lens"):
        a.alloc_decode(torch.tensor([1.0]), torch.tensor([-1]))
    with pytest.raises(ValueError, match="multiple of page_size"):
        a.alloc(3)
    got = a.alloc(2)
    assert got is not None
    a.free(got)
    with pytest.raises(ValueError, match="double free"):
        a.free(got)
    with pytest.raises(ValueError, match="outside"):
        a.free(torch.tensor([99]))


def test_scrub_on_alloc_zeroes_whole_new_pages():
    class FakePool:
        def __init__(self):
            self.zeroed: list[int] = []

        def zero_slots(self, idx: torch.Tensor) -> None:
            self.zeroed += idx.tolist()

    pool = FakePool()
    a = PagedTokenToKVPoolAllocator(12, 3, "cpu", kvcache=pool, scrub_on_alloc=True)
    out = a.alloc_extend(torch.tensor([0]), torch.tensor([4]), torch.tensor([-1]), 4)
    assert out is not None
    assert sorted(pool.zeroed) == [3, 4, 5, 6, 7, 8]  # both new pages, all slots
    pool.zeroed.clear()
    a.alloc_decode(torch.tensor([5]), out[-1:])  # same page: nothing new to scrub
    assert pool.zeroed == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_paged_allocator_on_cuda_matches_cpu():
    cpu = PagedTokenToKVPoolAllocator(64, 4, "cpu")
    gpu = PagedTokenToKVPoolAllocator(64, 4, "cuda")
    args = (torch.tensor([0, 3, 0]), torch.tensor([5, 9, 0]), torch.tensor([-1, 6, -1]), 11)
    out_c = cpu.alloc_extend(*args)
    out_g = gpu.alloc_extend(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
    assert out_g is not None and out_g.is_cuda and torch.equal(out_g.cpu(), out_c)
    dec = (torch.tensor([6, 10]), torch.tensor([8, 12]))
    assert torch.equal(gpu.alloc_decode(*(d.cuda() for d in dec)).cpu(), cpu.alloc_decode(*dec))
    gpu.free(out_g)
    cpu.free(out_c)
    assert gpu.available_size() == cpu.available_size()

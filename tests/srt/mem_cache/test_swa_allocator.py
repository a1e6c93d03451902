"""SWATokenToKVPoolAllocator on its own: random alloc / evict / free sequences with bad calls
mixed in (hypothesis). Free counts stay consistent, no slot is owned twice, the full -> window
mapping matches what requests hold, and every rejected call leaves both allocators and the
mapping exactly as they were (issue 50: `free_swa` used to free the window pages and then fail
on a bad full slot, leaving the mapping pointing at freed window slots)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from srt.mem_cache.swa_memory_pool import SWAKVPool


def _t(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


class SWASim:
    """Requests as token lists: each token's full slot, and its window slot (None once the
    token's window page was freed; a request's window pages cover its tokens from swa_start)."""

    def __init__(self, ps: int, pages: int, swa_pages: int) -> None:
        self.ps = ps
        self.pool = SWAKVPool(
            pages * ps, swa_pages * ps, ps, torch.float32, 1, 4, [0], [1], 2, "cpu"
        )
        self.a = SWATokenToKVPoolAllocator(pages * ps, swa_pages * ps, ps, "cpu", self.pool)
        self.full: dict[int, list[int]] = {}
        self.swa: dict[int, list[int | None]] = {}
        self.next_id = 0

    def state(self) -> tuple:
        f, w = self.a.full_attn_allocator, self.a.swa_attn_allocator
        return (
            f.free_pages.tolist(),
            f._live.tolist(),
            w.free_pages.tolist(),
            w._live.tolist(),
            self.pool.full_to_swa_index_mapping.tolist(),
        )

    def rejected(self, call, exc: type[Exception], match: str | None = None) -> None:
        before = self.state()
        with pytest.raises(exc, match=match):
            call()
        assert self.state() == before

    # ---- good operations
    def extend(self, rids: list[int], lens: list[int]) -> None:
        prefix = [len(self.full.get(r, [])) for r in rids]
        seq = [p + n for p, n in zip(prefix, lens, strict=True)]
        last = [self.full[r][-1] if p else -1 for r, p in zip(rids, prefix, strict=True)]
        swa_last = [self.swa[r][-1] if p else -1 for r, p in zip(rids, prefix, strict=True)]
        before = self.state()
        got = self.a.alloc_extend(
            _t(prefix), _t(seq), _t(last), sum(lens), swa_last_loc=_t(swa_last)
        )
        if got is None:
            assert self.state() == before  # either pool full: nothing taken
            return
        full, swa = got.full.tolist(), got.swa.tolist()
        for r, n in zip(rids, lens, strict=True):
            self.full.setdefault(r, []).extend(full[:n])
            self.swa.setdefault(r, []).extend(swa[:n])
            full, swa = full[n:], swa[n:]

    def decode(self, rids: list[int]) -> None:
        seq = [len(self.full[r]) + 1 for r in rids]
        last = [self.full[r][-1] for r in rids]
        swa_last = [self.swa[r][-1] for r in rids]
        before = self.state()
        got = self.a.alloc_decode(_t(seq), _t(last), swa_last_loc=_t(swa_last))
        if got is None:
            assert self.state() == before
            return
        for r, f, w in zip(rids, got.full.tolist(), got.swa.tolist(), strict=True):
            self.full[r].append(f)
            self.swa[r].append(w)

    def _window_pages(self, r: int, upto: int) -> tuple[list[int], list[int]]:
        """First window slot of each held window page wholly before token `upto`, and the
        full slots of all their tokens."""
        ps, swa, full = self.ps, self.swa[r], self.full[r]
        first, toks = [], []
        for start in range(0, upto - upto % ps, ps):
            if swa[start] is not None:
                first.append(swa[start] - start % ps)
                toks += full[start : start + ps]
        return first, toks

    def evict(self, r: int) -> None:
        """Free the window pages before the page of the request's last token."""
        n = len(self.full[r])
        first, toks = self._window_pages(r, (n - 1) // self.ps * self.ps)
        if first:
            self.a.free_swa(_t(first), _t(toks))
            for t in range((n - 1) // self.ps * self.ps):
                self.swa[r][t] = None

    def finish(self, r: int) -> None:
        n = len(self.full[r])
        ps = self.ps
        first, toks = self._window_pages(r, -(-n // ps) * ps)
        if first:
            self.a.free_swa(_t(first), _t(toks))
        if self.full[r]:
            self.a.free(_t(self.full[r]))
        del self.full[r], self.swa[r]

    # ---- invariants
    def check(self) -> None:
        ps, f, w = self.ps, self.a.full_attn_allocator, self.a.swa_attn_allocator
        full_slots = [s for slots in self.full.values() for s in slots]
        swa_slots = [s for slots in self.swa.values() for s in slots if s is not None]
        assert len(set(full_slots)) == len(full_slots), "full slot owned twice"
        assert len(set(swa_slots)) == len(swa_slots), "window slot owned twice"
        full_pages = {s // ps for s in full_slots}
        swa_pages = {s // ps for s in swa_slots}
        for alloc, held in ((f, full_pages), (w, swa_pages)):
            free = alloc.free_pages.tolist()
            assert 0 not in held and 0 not in free
            assert len(set(free)) == len(free) and not set(free) & held
            assert len(free) + len(held) == alloc.num_pages, "leaked pages"
            assert alloc.available_size() == len(free) * ps
            assert {p for p, x in enumerate(alloc._live.tolist()) if x} == held
        mapping = self.pool.full_to_swa_index_mapping.tolist()
        want = [-1] * len(mapping)
        want[:ps] = range(ps)  # padding -> padding
        for r in self.full:
            for full, swa in zip(self.full[r], self.swa[r], strict=True):
                want[full] = -1 if swa is None else swa
        assert mapping == want


def _bad_op(sim: SWASim, kind: int, data: st.DataObject) -> None:
    """A call both allocators must reject without changing anything."""
    a, ps = sim.a, sim.ps
    n_full = sim.pool.full_kv_pool.num_slots
    live = sorted(r for r in sim.full if sim.full[r])
    held_swa = [(r, t) for r in live for t, s in enumerate(sim.swa[r]) if s is not None]
    if kind == 0 and held_swa:  # a good window page, a full slot out of range / unallocated
        r, t = data.draw(st.sampled_from(held_swa))
        page_first = sim.swa[r][t] - t % ps
        free_full = sorted(
            set(range(ps, n_full)) - {s for slots in sim.full.values() for s in slots}
        )
        bad = data.draw(st.sampled_from([-1, 0, n_full, n_full + 7, *free_full[:2]]))
        if bad >= 0 and bad // ps in {s // ps for x in sim.full.values() for s in x}:
            return  # a free slot of a held (partly filled) page is allocated, page-wise
        good = sim.full[r][t]
        call = lambda: a.free_swa(_t([page_first]), _t([good, bad]))
        sim.rejected(call, ValueError, f"full_index: slot {bad} ")
    elif kind == 1 and held_swa:  # a window page listed twice, or one never handed out
        r, t = data.draw(st.sampled_from(held_swa))
        s = sim.swa[r][t]
        swa_free = a.swa_attn_allocator.free_pages.tolist()
        twice = data.draw(st.booleans()) or not swa_free
        other = s if twice else swa_free[0] * ps
        call = lambda: a.free_swa(_t([s, other]), _t([sim.full[r][t]]))
        sim.rejected(call, ValueError, "swa_index")
    elif kind == 2:  # wrong types anywhere
        args = data.draw(
            st.sampled_from(
                [
                    (torch.tensor([1.0]), _t([1])),
                    (_t([ps]), torch.tensor([1.0])),
                    ([ps], _t([ps])),
                    (_t([ps]), [ps]),
                ]
            )
        )
        sim.rejected(lambda: a.free_swa(*args), TypeError)
    elif kind == 3:
        call = lambda: a.alloc_extend(_t([0]), _t([2]), _t([-1]), 2.0, swa_last_loc=_t([-1]))
        sim.rejected(call, TypeError, "extend_num_tokens")
    elif kind == 4 and len(live) >= 2:  # another request's window slot as swa_last_loc
        r, o = live[:2]
        if len(sim.full[r]) % ps == 0:
            return  # r's last page is full: many requests may name a full page (a shared prefix)
        new_pages = sum(len(sim.full[x]) % ps == 0 for x in (r, o))
        if a.available_size() < new_pages * ps:
            return  # the full pool is full: the call returns None before the window check
        seq = _t([len(sim.full[r]) + 1, len(sim.full[o]) + 1])
        last = _t([sim.full[r][-1], sim.full[o][-1]])
        swa_last = [sim.swa[r][-1], sim.swa[r][-1]]
        call = lambda: a.alloc_decode(seq, last, swa_last_loc=_t(swa_last))
        sim.rejected(call, ValueError, "last_loc")
    elif kind == 5 and live:  # out-of-range full slots straight into the pool's reset
        call = lambda: sim.pool.reset_swa_mapping(_t([n_full]))
        sim.rejected(call, ValueError, f"slot {n_full} is outside")


@settings(max_examples=60, deadline=None)
@given(
    ps=st.sampled_from([1, 2, 4]),
    pages=st.integers(2, 10),
    swa_pages=st.integers(1, 8),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["new", "extend", "decode", "evict", "finish", "bad"]),
            st.integers(0, 2**16),
        ),
        min_size=1,
        max_size=40,
    ),
    data=st.data(),
)
def test_random_swa_sequences_stay_exact(ps, pages, swa_pages, ops, data):
    sim = SWASim(ps, pages, swa_pages)
    for op, seed in ops:
        live = sorted(r for r in sim.full if sim.full[r])
        if op == "new" or not live:
            k = 1 + seed % 2
            lens = data.draw(st.lists(st.integers(1, 2 * ps + 1), min_size=k, max_size=k))
            sim.extend(list(range(sim.next_id, sim.next_id + k)), lens)
            sim.next_id += k
        elif op == "extend":
            r = live[seed % len(live)]
            sim.extend([r], [data.draw(st.integers(1, 2 * ps))])
        elif op == "decode":
            sim.decode(live[: 1 + seed % len(live)])
        elif op == "evict":
            sim.evict(live[seed % len(live)])
        elif op == "finish":
            sim.finish(live[seed % len(live)])
        else:
            _bad_op(sim, seed % 6, data)
        sim.check()
    for r in list(sim.full):
        sim.finish(r)
    sim.check()
    assert sim.a.available_size() == pages * ps and sim.a.swa_available_size() == swa_pages * ps


def test_issue50_free_swa_with_a_bad_full_slot_frees_nothing():
    """The old free_swa freed the window pages, then raised on the full index (IndexError),
    leaving the mapping pointing at window slots that were free again."""
    sim = SWASim(2, 4, 4)
    sim.extend([0], [4])
    n = sim.pool.full_kv_pool.num_slots
    first, toks = sim._window_pages(0, 2)
    for bad in (n, -1, 0, 9):
        full = _t([*toks, bad])
        sim.rejected(lambda: sim.a.free_swa(_t(first), full), ValueError, "full_index")  # noqa: B023
    sim.check()
    sim.evict(0)  # the good call still works
    sim.check()

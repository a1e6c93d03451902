"""No data crosses between requests: slots a request reads were written by it (or scrubbed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

H, D = 2, 4
LAYER = SimpleNamespace(layer_id=0)


def token_value(rid: int, pos: int) -> torch.Tensor:
    """A K/V row that identifies its request and position: [1, H, D] float32."""
    return torch.full((1, H, D), rid * 1000.0 + pos)


class Engine:
    """A minimal scheduler: extend/decode requests, write their KV, finish them."""

    def __init__(self, page_size: int, pages: int, scrub: bool) -> None:
        size = page_size * pages
        self.ps = page_size
        self.kv = MHATokenToKVPool(size, page_size, torch.float32, H, D, 1, "cpu")
        self.alloc = PagedTokenToKVPoolAllocator(
            size, page_size, "cpu", kvcache=self.kv, scrub_on_alloc=scrub
        )
        self.req_to_token = ReqToTokenPool(8, 64, "cpu")
        self.lens: dict[int, int] = {}  # request slot -> seq_len
        self.rid_of: dict[int, int] = {}  # request slot -> request id

    def poison(self) -> None:
        """What a previous user left behind in every slot."""
        for b in self.kv.k_buffer + self.kv.v_buffer:
            b.fill_(float("nan"))

    def extend(self, rid: int, n: int, r: int | None = None) -> int | None:
        if r is None:
            got = self.req_to_token.alloc(1)
            if got is None:
                return None
            r = got[0]
            self.lens[r], self.rid_of[r] = 0, rid
        prefix = self.lens[r]
        last = int(self.req_to_token.req_to_token[r, prefix - 1]) if prefix else -1
        out = self.alloc.alloc_extend(
            torch.tensor([prefix]), torch.tensor([prefix + n]), torch.tensor([last]), n
        )
        if out is None:
            if prefix == 0:
                self.req_to_token.free(r)
                del self.lens[r], self.rid_of[r]
            return None
        self.req_to_token.req_to_token[r, prefix : prefix + n] = out.to(torch.int32)
        if n:
            rows = torch.cat([token_value(self.rid_of[r], p) for p in range(prefix, prefix + n)])
            self.kv.set_kv_buffer(LAYER, out, rows, -rows)
        self.lens[r] = prefix + n
        return r

    def finish(self, r: int) -> None:
        self.alloc.free(self.req_to_token.req_to_token[r, : self.lens[r]].to(torch.int64))
        self.req_to_token.free(r)
        del self.lens[r], self.rid_of[r]

    def read(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads for request slot r: K and V of its first seq_len tokens."""
        loc = self.req_to_token.req_to_token[r, : self.lens[r]].long()
        k, v = self.kv.get_kv_buffer(0)
        if k.ndim == 4:
            return k[loc // self.ps, loc % self.ps], v[loc // self.ps, loc % self.ps]
        return k[loc], v[loc]

    def check_reads(self) -> None:
        for r, n in self.lens.items():
            k, v = self.read(r)
            want = torch.cat(
                [token_value(self.rid_of[r], p) for p in range(n)] or [torch.empty(0, H, D)]
            )
            assert torch.equal(k, want), f"request {self.rid_of[r]} reads foreign/stale K"
            assert torch.equal(v, -want)


@settings(max_examples=40, deadline=None)
@given(
    page_size=st.sampled_from([1, 3, 4]),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 9)), min_size=1, max_size=30),
)
def test_every_slot_a_request_reads_was_written_by_it(page_size, steps):
    """Without scrubbing: on a poisoned pool, no request ever reads NaN or another's data."""
    eng = Engine(page_size, pages=6, scrub=False)
    eng.poison()
    rid = 0
    for op, n in steps:
        live = sorted(eng.lens)
        if op == 0 or not live:
            rid += 1
            eng.extend(rid, n)
        elif op == 1:
            eng.extend(0, n % 4, r=live[n % len(live)])
        elif op == 2:
            for r in live:
                eng.extend(0, 1, r=r)  # decode step
        else:
            eng.finish(live[n % len(live)])
        eng.check_reads()


@pytest.mark.parametrize("page_size", [1, 4])
def test_scrub_on_alloc_clears_pages_handed_to_a_new_request(page_size):
    eng = Engine(page_size, pages=2, scrub=True)
    a = eng.extend(1, 2 * page_size - 1)  # request 1 fills both pages (last one partly)
    assert a is not None
    eng.finish(a)
    b = eng.extend(2, 1)  # request 2 gets a page request 1 used
    assert b is not None
    k, v = eng.kv.get_kv_buffer(0)
    slot = int(eng.req_to_token.req_to_token[b, 0])
    page_rows = k.reshape(-1, H, D)[slot - slot % page_size : slot - slot % page_size + page_size]
    assert torch.equal(page_rows[slot % page_size], token_value(2, 0)[0])
    others = [i for i in range(page_size) if i != slot % page_size]
    assert not page_rows[others].any()  # rest of the page: zero, not request 1's data
    eng.check_reads()


def test_without_scrub_stale_data_stays_but_is_never_read():
    """The counter-case that motivates the option: the bytes survive, only reads are clean."""
    eng = Engine(4, pages=1, scrub=False)
    a = eng.extend(1, 3)
    eng.finish(a)
    b = eng.extend(2, 1)
    k = eng.kv.get_key_buffer(0).reshape(-1, H, D)
    assert torch.equal(k[5], token_value(1, 1)[0])  # request 1's token still in memory ...
    eng.check_reads()  # ... but request 2 reads only its own token
    assert eng.lens[b] == 1

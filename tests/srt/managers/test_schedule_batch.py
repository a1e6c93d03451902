"""ScheduleBatch's memory paths: host page lists agree with req_to_token, failures give back
what they took, misuse is refused, and the decode path needs no device sync (GPU)."""

from __future__ import annotations

import pytest
import torch

from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.sampling.sampling_params import SamplingParams

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ROWS, CTX = 4, 96


def _batch(page_size: int, pages: int, device: str = "cpu") -> ScheduleBatch:
    alloc = PagedTokenToKVPoolAllocator(page_size * pages, page_size, device)
    rows = ReqToTokenPool(ROWS, CTX, device)
    return ScheduleBatch(rows, alloc, None, None, page_size, torch.device(device), True)


def _reqs(lens: list[int], seed: int = 0) -> list[Req]:
    g = torch.Generator().manual_seed(seed)
    return [
        Req(i, torch.randint(0, 100, (n,), generator=g).tolist(), SamplingParams())
        for i, n in enumerate(lens)
    ]


def _counts(sb: ScheduleBatch) -> tuple[int, int]:
    return sb.allocator.available_size(), sb.req_to_token_pool.available_size()


def _host_slots(req: Req, ps: int) -> list[int]:
    return [req.kv_pages[i // ps] * ps + i % ps for i in range(req.kv_len)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_host_pages_match_req_to_token_through_decode(page_size):
    sb = _batch(page_size, pages=80 // page_size + 20)
    start = _counts(sb)
    reqs = _reqs([1, 7, 33])
    fb = sb.prepare_for_extend(reqs)
    want = [s for r in reqs for s in _host_slots(r, page_size)]
    assert fb.out_cache_loc.tolist() == want
    for step in range(2 * page_size + 3):
        for r in reqs:
            r.output_ids.append(step)
        fb = sb.prepare_for_decode(reqs)
        assert fb.out_cache_loc.tolist() == [_host_slots(r, page_size)[-1] for r in reqs]
        assert fb.positions.tolist() == [r.kv_len - 1 for r in reqs]
        assert fb.seq_lens.tolist() == fb.seq_lens_cpu.tolist() == [r.kv_len for r in reqs]
        assert fb.input_ids.tolist() == [step] * len(reqs)
        # the five decode inputs are the rows of one block (one copy into a graph's inputs)
        block = fb.decode_inputs
        assert block.shape == (5, len(reqs)) and block.dtype == torch.int64
        fields = (fb.input_ids, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, fb.positions)
        assert all(f.data_ptr() == block[i].data_ptr() for i, f in enumerate(fields))
    table = sb.req_to_token_pool.req_to_token
    every = []
    for r in reqs:
        slots = _host_slots(r, page_size)
        assert table[r.req_pool_idx, : r.kv_len].tolist() == slots
        assert len(r.kv_pages) == -(-r.kv_len // page_size)
        every += slots
    assert len(set(every)) == len(every) and min(every) >= page_size  # no sharing, no page 0
    for r in reqs:
        sb.free_req(r)
        sb.free_req(r)  # a second free is a no-op: the request holds nothing any more
    assert _counts(sb) == start


def test_extend_that_does_not_fit_gives_back_the_rows():
    sb = _batch(4, pages=3)
    start = _counts(sb)
    reqs = _reqs([5, 9])  # 2 + 3 pages > 3
    with pytest.raises(RuntimeError, match="out of memory"):
        sb.prepare_for_extend(reqs)
    assert _counts(sb) == start
    assert all(r.req_pool_idx is None and r.kv_len == 0 and not r.kv_pages for r in reqs)
    sb.prepare_for_extend(reqs[:1])  # the pools still work
    assert _counts(sb) == (4, ROWS - 1)


def test_no_free_row_takes_no_kv():
    sb = _batch(1, pages=64)
    start = _counts(sb)
    with pytest.raises(RuntimeError, match="no room"):
        sb.prepare_for_extend(_reqs([1] * (ROWS + 1)))
    assert _counts(sb) == start


def test_decode_that_does_not_fit_changes_nothing():
    sb = _batch(2, pages=2)
    reqs = _reqs([2, 2])
    sb.prepare_for_extend(reqs)
    for r in reqs:
        r.output_ids.append(1)
    before = (_counts(sb), [r.kv_len for r in reqs], [list(r.kv_pages) for r in reqs])
    with pytest.raises(RuntimeError, match="out of memory"):
        sb.prepare_for_decode(reqs)  # both start a page: 2 pages, none free
    assert (_counts(sb), [r.kv_len for r in reqs], [list(r.kv_pages) for r in reqs]) == before


def test_misuse_is_refused_before_anything_is_taken():
    sb = _batch(1, pages=32)
    reqs = _reqs([3])
    with pytest.raises(ValueError, match="not prefilled"):
        sb.prepare_for_decode(reqs)
    sb.prepare_for_extend(reqs)
    counts = _counts(sb)
    with pytest.raises(ValueError, match="already holds memory"):
        sb.prepare_for_extend(reqs)
    assert _counts(sb) == counts
    sb.free_req(reqs[0])
    with pytest.raises(ValueError, match="not prefilled"):
        sb.prepare_for_decode(reqs)


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_and_kv_frees_need_no_device_sync(page_size):
    """prepare_for_decode and the allocator's free run with CUDA sync debugging set to error."""
    sb = _batch(page_size, pages=64, device="cuda")
    reqs = _reqs([1, 7, 33])
    sb.prepare_for_extend(reqs)
    for r in reqs:
        r.output_ids.append(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2 * page_size + 1):
            fb = sb.prepare_for_decode(reqs)
        pages = [torch.tensor(r.kv_pages) * page_size for r in reqs]
        for p in pages:
            sb.allocator.free(p)  # what free_req does for the KV (the row reset is separate)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fb.out_cache_loc.is_cuda and fb.out_cache_loc.tolist() == [
        r.kv_pages[(r.kv_len - 1) // page_size] * page_size + (r.kv_len - 1) % page_size
        for r in reqs
    ]
    assert sb.allocator.available_size() == 64 * page_size

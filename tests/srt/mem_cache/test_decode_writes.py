"""A decode step's table writes in one launch (srt/mem_cache/decode_writes.py), and the
allocators' deferred scrub that rides on the same upload.

On CPU the Triton kernel runs under TRITON_INTERPRET=1 (tests/conftest.py sets it); on CUDA the
same test runs it compiled.
"""

import os

import pytest
import torch

from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from srt.mem_cache.decode_writes import StepExtras, write_decode_rows, write_decode_rows_native
from srt.mem_cache.scrub import slot_table

DEV = "cuda" if torch.cuda.is_available() else "cpu"
interp = pytest.mark.skipif(
    DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1",
)


def _case(b: int, swa: bool, ids: bool, seed: int):
    """A block of b requests at distinct (row, position) cells, poisoned tables, fresh ids."""
    g = torch.Generator().manual_seed(seed)
    n_rows, ctx, n_slots = b + 3, 61, 4 * b + 17
    cells = torch.randperm(n_rows * ctx, generator=g)[:b]  # distinct cells
    slots = torch.randperm(n_slots, generator=g)[:b]  # distinct slots (the mapping's keys)
    block = [
        torch.randint(0, 50000, (b,), generator=g),  # input ids
        cells // ctx,  # rows
        torch.randint(1, ctx, (b,), generator=g),  # seq lens (not written anywhere)
        slots,
        cells % ctx,  # positions
    ]
    if swa:
        block.append(torch.randint(0, 3 * b + 5, (b,), generator=g))
    block_t = torch.stack(block).to(DEV)  # int64 [5 or 6, b]
    r2t = torch.randint(-9, -1, (n_rows, ctx), generator=g, dtype=torch.int32).to(DEV)
    r2s = torch.randint(-9, -1, (n_rows, ctx), generator=g, dtype=torch.int32).to(DEV)
    mapping = torch.randint(-9, -1, (n_slots,), generator=g).to(DEV)
    new_ids = torch.randint(0, 50000, (b,), generator=g).to(DEV) if ids else None
    return block_t, r2t, r2s if swa else None, mapping if swa else None, new_ids


def _clone(args):
    return [None if a is None else a.clone() for a in args]


@interp
@pytest.mark.parametrize("b", [1, 7, 33, 257])
@pytest.mark.parametrize("swa", [False, True])
@pytest.mark.parametrize("ids", [False, True])
def test_kernel_writes_exactly_what_the_torch_ops_write(b, swa, ids):
    args = _case(b, swa, ids, seed=b * 4 + 2 * swa + ids)
    want, got = _clone(args), _clone(args)
    write_decode_rows_native(*want)
    write_decode_rows(*got, use_kernel=True)
    for w, g in zip(want, got, strict=True):
        assert (w is None) == (g is None)
        if w is not None:
            assert torch.equal(w, g)
    block, r2t = got[0], got[1]
    rows, slots, pos = block[1], block[3], block[4]
    assert torch.equal(r2t[rows, pos], slots.to(torch.int32))  # the cells hold the slots ...
    assert int((r2t >= 0).sum()) == b  # ... and nothing else was written
    if ids:
        assert torch.equal(block[0], args[4])
    if swa:
        assert torch.equal(got[2][rows, pos], block[5].to(torch.int32))
        assert torch.equal(got[3][slots], block[5])
        assert int((got[3] >= 0).sum()) == int((block[5] >= 0).sum())


@pytest.mark.parametrize("use_kernel", [False, True])
def test_bad_arguments_raise_before_any_write(use_kernel):
    block, r2t, r2s, mapping, ids = _case(5, True, True, seed=3)
    before = _clone([block, r2t, r2s, mapping])
    bad = [
        ((block.float(), r2t, r2s, mapping, ids), "block must be int64"),
        ((block[:5].contiguous(), r2t, r2s, mapping, ids), r"block must be int64 \[6, B\]"),
        ((block.t().contiguous().t(), r2t, r2s, mapping, ids), "contiguous"),
        ((block, r2t, r2s, None, ids), "go together"),
        ((block, r2t.long(), r2s, mapping, ids), "req_to_token must be int32"),
        ((block, r2t, r2s, mapping.int(), ids), "mapping must be int64"),
        ((block, r2t, r2s, mapping, ids[:3]), r"input_ids must be int64 \[5\]"),
        ((block, r2t, r2s, mapping, ids.int()), "input_ids must be int64"),
    ]
    for args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            write_decode_rows(*args, use_kernel=use_kernel)
    for b, t in zip(before, [block, r2t, r2s, mapping], strict=True):
        assert torch.equal(b, t)


class _Pool:
    def __init__(self):
        self.zeroed = []

    def zero_slots(self, indices):
        self.zeroed.append(indices.tolist())


@pytest.mark.parametrize("page_size", [1, 4])
def test_deferred_scrub_lists_the_pages_instead_of_zeroing_them(page_size):
    pool = _Pool()
    a = PagedTokenToKVPoolAllocator(
        16 * page_size, page_size, "cpu", kvcache=pool, scrub_on_alloc=True
    )
    first = a.alloc(2 * page_size)  # scrubbed at once, outside the block
    assert pool.zeroed == [first.tolist()]
    with a.deferred_scrub() as scrubs:
        slots = a.alloc(3 * page_size)
    assert pool.zeroed == [first.tolist()]  # nothing zeroed inside the block ...
    assert [(p, s.tolist()) for p, s in scrubs] == [(pool, slots.tolist())]  # ... but listed
    a.alloc(page_size)
    assert len(pool.zeroed) == 2  # after the block, scrubs run again


def test_swa_failure_drops_the_full_pages_deferred_scrub():
    """The window pool is full: the full pages just taken are given back, and their listed
    scrub goes with them (nothing of the failed allocation is left for the caller)."""
    from srt.mem_cache.swa_allocator import SWATokenToKVPoolAllocator

    class _SWAPool(_Pool):
        def __init__(self):
            super().__init__()
            self.swa_kv_pool = _Pool()

        def set_swa_mapping(self, full, swa):
            pass

    pool = _SWAPool()
    a = SWATokenToKVPoolAllocator(16, 2, 1, "cpu", pool, scrub_on_alloc=True)
    with a.deferred_scrub() as scrubs:
        got = a.alloc_extend(
            torch.tensor([0]),
            torch.tensor([2]),
            torch.tensor([0]),
            2,
            swa_last_loc=torch.tensor([0]),
        )
        assert got is not None and len(scrubs) == 2  # full and window pages listed
        free_full = a.available_size()
        seq, last = torch.tensor([3]), got.full[-1:]
        none = a.alloc_decode(seq, last, swa_last_loc=got.swa[-1:])  # the window pool is full
        assert none is None and a.available_size() == free_full
        assert len(scrubs) == 2
    assert pool.zeroed == [] and pool.swa_kv_pool.zeroed == []


@interp
def test_kernel_skips_entries_outside_the_tables():
    """A broken block (a row, position or slot past the tables) cannot make the kernel write
    out of bounds: those entries are skipped, the valid ones written."""
    block, r2t, r2s, mapping, _ = _case(7, True, False, seed=9)
    block[1, 0] = r2t.shape[0]  # row past the table
    block[4, 1] = -1  # negative position
    block[3, 2] = mapping.shape[0] + 5  # slot past the mapping
    got = _clone([block, r2t, r2s, mapping])
    write_decode_rows(*got, use_kernel=True)
    ok = [i for i in range(7) if i not in (0, 1)]
    rows, pos = block[1, ok], block[4, ok]
    assert torch.equal(got[1][rows, pos], block[3, ok].to(torch.int32))
    assert int((got[1] >= 0).sum()) == len(ok)
    assert int((got[3] >= 0).sum()) == int((block[5, [0, 1, 3, 4, 5, 6]] >= 0).sum())


class _TablePool:
    """A pool of K/V-like buffers: zero_slots by indexing (the reference), and the table the
    kernel zeroes them through."""

    def __init__(self, bufs):
        self.bufs = bufs

    def zero_slots(self, indices):
        for b in self.bufs:
            b[indices] = 0

    def scrub_table(self):
        return slot_table(self.bufs)


def _pools(g, n_slots):
    """Two pools of poisoned buffers with different slot sizes and word widths."""
    a = [torch.randn(n_slots, 3, 8, generator=g).to(torch.bfloat16).to(DEV) for _ in range(2)]
    b = [torch.randint(1, 200, (n_slots, 5), generator=g, dtype=torch.uint8).to(DEV)]
    return _TablePool(a), _TablePool(b)


def _extras_case(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    block, r2t, r2s, mapping, ids = _case(b, True, True, seed)
    n_map = mapping.shape[0]
    new = set(block[3].tolist())
    resets = torch.tensor([s for s in torch.randperm(n_map, generator=g).tolist() if s not in new])
    resets = resets[: b + 5].to(DEV)  # more resets than requests: programs cover both
    wide = torch.randint(-99, -10, (6, b + 4), generator=g).to(DEV)  # dest: a strided view
    host = torch.full((b,), -7, dtype=torch.int64, pin_memory=DEV == "cuda")
    pa, pb = _pools(g, 11)
    scrubs = [(pa, torch.tensor([4, 0, 9]).to(DEV)), (pb, torch.tensor([10, 3]).to(DEV))]
    return (block, r2t, r2s, mapping, ids), wide, host, resets, (pa, pb), scrubs


@interp
@pytest.mark.parametrize("b", [1, 7, 33])
def test_kernel_extras_write_exactly_what_the_torch_ops_write(b):
    """dest, host ids, mapping resets and two pools' scrubs in the one launch: equal to the
    torch ops, and nothing else written (dest's other columns, other slots)."""
    runs = []
    for use_kernel in (False, True):
        args, wide, host, resets, pools, scrubs = _extras_case(b, seed=40 + b)
        extras = StepExtras(dest=wide[:, :b], host_ids=host, resets=resets, scrubs=scrubs)
        write_decode_rows(*args, extras, use_kernel=use_kernel)
        runs.append((args, wide, host, pools))
    (want, w_wide, w_host, w_pools), (got, g_wide, g_host, g_pools) = runs
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
    assert torch.equal(w_wide, g_wide) and torch.equal(w_host, g_host)
    for wp, gp in zip(w_pools, g_pools, strict=True):
        for wb, gb in zip(wp.bufs, gp.bufs, strict=True):
            assert torch.equal(wb, gb)
    args, wide, host, resets, pools, scrubs = _extras_case(b, seed=40 + b)  # the inputs again
    assert torch.equal(g_wide[:, :b], got[0]) and torch.equal(g_wide[:, b:], wide[:, b:])
    assert torch.equal(g_host, args[4].cpu())
    assert bool((got[3][resets] == -1).all())
    assert torch.equal(got[3][got[0][3]], got[0][5])  # the new entries survive the resets
    for (pool, slots), g_pool in zip(scrubs, g_pools, strict=True):
        for before, after in zip(pool.bufs, g_pool.bufs, strict=True):
            hit = torch.zeros(before.shape[0], dtype=torch.bool, device=DEV)
            hit[slots] = True
            assert bool((after[hit] == 0).all()) and torch.equal(after[~hit], before[~hit])


@pytest.mark.parametrize("use_kernel", [False, True])
def test_bad_extras_raise_before_any_write(use_kernel):
    args, wide, host, resets, pools, scrubs = _extras_case(5, seed=7)
    block, r2t, r2s, mapping, ids = args
    before = _clone([block, r2t, r2s, mapping, wide, host, *pools[0].bufs, *pools[1].bufs])
    ok = dict(dest=wide[:, :5], host_ids=host, resets=resets, scrubs=scrubs)
    bad = [
        (dict(ok, dest=wide[:5, :5]), r"dest must be int64 \(6, 5\)"),
        (dict(ok, dest=wide[:, :5].t().contiguous().t()), "contiguous rows"),
        (dict(ok, host_ids=host[:3]), r"host_ids must be int64 \[5\]"),
        (dict(ok, resets=resets.int()), "resets must be int64"),
        (dict(ok, scrubs=[(pools[0], scrubs[0][1].int())]), "scrub slots must be int64"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            write_decode_rows(*args, StepExtras(**kw), use_kernel=use_kernel)
    if DEV == "cuda":
        with pytest.raises(ValueError, match="pinned"):
            write_decode_rows(*args, StepExtras(host_ids=host.clone()), use_kernel=use_kernel)
    with pytest.raises(ValueError, match="host_ids needs input_ids"):
        write_decode_rows(block, r2t, r2s, mapping, None, StepExtras(host_ids=host))
    with pytest.raises(ValueError, match="resets need the mapping"):
        write_decode_rows(block[:5].contiguous(), r2t, None, None, ids, StepExtras(resets=resets))
    after = [block, r2t, r2s, mapping, wide, host, *pools[0].bufs, *pools[1].bufs]
    for b, t in zip(before, after, strict=True):
        assert torch.equal(b, t)

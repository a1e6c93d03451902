"""The hybrid sliding-window KV pool: routing of layers, the full -> window mapping, exact
allocation under random request lifecycles (hypothesis), and the memory arithmetic."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.managers.schedule_batch import Req, ScheduleBatch
from srt.mem_cache.kv_memory import (
    KVCacheShape,
    hybrid_token_capacity,
    kv_memory_report,
    swa_pool_size,
    swa_tokens_per_request,
)
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.swa_allocator import SWATokenToKVPoolAllocator
from srt.mem_cache.swa_memory_pool import SWAKVPool
from srt.sampling.sampling_params import SamplingParams

H, D = 2, 8


def _pool(size=64, size_swa=32, ps=1, window=3, dtype=torch.float32) -> SWAKVPool:
    # gpt-oss order: even layers slide, odd layers are full
    return SWAKVPool(size, size_swa, ps, dtype, H, D, [0, 2], [1, 3], window, "cpu")


class _Layer:
    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


# ---------------------------------------------------------------------------- the pool
def test_layers_route_to_their_pool():
    pool = _pool(size=64, size_swa=32)
    assert pool.is_swa_layer(0) and pool.is_swa_layer(2)
    assert not pool.is_swa_layer(1) and not pool.is_swa_layer(3)
    assert pool.get_key_buffer(2).shape == (33, H, D)  # window slots + padding slot
    assert pool.get_value_buffer(3).shape == (65, H, D)
    assert pool.get_key_buffer(0).data_ptr() == pool.swa_kv_pool.get_key_buffer(0).data_ptr()
    assert pool.get_key_buffer(3).data_ptr() == pool.full_kv_pool.get_key_buffer(1).data_ptr()
    with pytest.raises(ValueError, match="layer_id 4"):
        pool.get_key_buffer(4)
    with pytest.raises(TypeError, match="layer_id"):
        pool.get_key_buffer(1.0)
    with pytest.raises(ValueError, match="cover"):
        SWAKVPool(8, 8, 1, torch.float32, H, D, [0, 2], [2], 3, "cpu")
    with pytest.raises(ValueError, match="sliding_window_size"):
        SWAKVPool(8, 8, 1, torch.float32, H, D, [0], [1], 0, "cpu")


def test_translate_and_unfused_write_use_window_slots():
    pool = _pool()
    g = torch.Generator().manual_seed(0)
    full = torch.tensor([5, 9, 17, 0, -1])
    pool.set_swa_mapping(full[:3], torch.tensor([3, 1, 30]))
    pool.reset_swa_mapping(torch.tensor([9]))  # token in slot 9 left the window
    got = pool.translate_loc_from_full_to_swa(full)
    assert got.tolist() == [3, -1, 30, 0, -1]  # slot 0 (padding) -> 0; loc < 0 stays -1
    for b in pool.swa_kv_pool.k_buffer + pool.full_kv_pool.k_buffer:
        b.fill_(float("nan"))  # poison: only the written rows may change
    for b in pool.swa_kv_pool.v_buffer + pool.full_kv_pool.v_buffer:
        b.fill_(float("nan"))
    k = torch.randn(5, H, D, generator=g)
    v = torch.randn(5, H, D, generator=g)
    pool.set_kv_buffer(_Layer(2), full, k, v)  # window layer: window slots
    pool.set_kv_buffer(_Layer(1), full, k, v)  # full layer: full slots
    kb, vb = pool.get_kv_buffer(2)
    assert torch.equal(kb[3], k[0]) and torch.equal(kb[30], k[2]) and torch.equal(kb[0], k[3])
    assert torch.equal(vb[3], v[0]) and torch.equal(vb[30], v[2])
    assert torch.isnan(kb[1]).all()  # the token without a window slot was not written
    kb, vb = pool.get_kv_buffer(1)
    assert torch.equal(kb[9], k[1]) and torch.equal(vb[17], v[2])
    assert torch.isnan(pool.get_key_buffer(0)).all()  # the other window layer is untouched
    pool.clear()
    assert pool.translate_loc_from_full_to_swa(full).tolist() == [-1, -1, -1, 0, -1]
    assert not pool.get_key_buffer(2).isnan().any()


def test_fused_arg_writes_window_slots():
    from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from srt.models.utils import create_fused_set_kv_buffer_arg

    pool = _pool()
    pool.set_swa_mapping(torch.tensor([4, 6]), torch.tensor([11, 12]))
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=torch.zeros(2, dtype=torch.int64),
        req_pool_indices=torch.zeros(2, dtype=torch.int64),
        seq_lens=torch.ones(2, dtype=torch.int64),
        out_cache_loc=torch.tensor([4, 6]),
        seq_lens_sum=2,
        token_to_kv_pool=pool,
    )
    v = torch.randn(2, H * D)
    arg = create_fused_set_kv_buffer_arg(v, _Layer(0), fb)  # translated on the fly
    assert arg.cache_loc.tolist() == [11, 12] and arg.k_buffer.shape[0] == 33
    arg = create_fused_set_kv_buffer_arg(v, _Layer(1), fb)
    assert arg.cache_loc.tolist() == [4, 6] and arg.k_buffer.shape[0] == 65
    fb.out_cache_loc_swa = torch.tensor([-1, 12])  # precomputed by the runner
    assert create_fused_set_kv_buffer_arg(v, _Layer(2), fb).cache_loc.tolist() == [-1, 12]


# ---------------------------------------------------------------------------- allocation
def _batch(size, size_swa, ps, window, rows=6, ctx=96):
    pool = _pool(size=size, size_swa=size_swa, ps=ps, window=window)
    alloc = SWATokenToKVPoolAllocator(size, size_swa, ps, "cpu", pool)
    r2t = ReqToTokenPool(rows, ctx, "cpu", enable_swa=True)
    return ScheduleBatch(r2t, alloc, pool, None, ps, torch.device("cpu"), True)


def _check(batch: ScheduleBatch, reqs: list[Req]) -> None:
    """No leak, no double use, page 0 never handed out, mappings and tables consistent."""
    a, ps, W = batch.allocator, batch.page_size, batch.sliding_window_size
    pool, r2t = batch.token_to_kv_pool, batch.req_to_token_pool
    full_pages = [p for r in reqs for p in r.kv_pages]
    swa_pages = [p for r in reqs for p in r.swa_pages]
    assert len(set(full_pages)) == len(full_pages) and 0 not in full_pages
    assert len(set(swa_pages)) == len(swa_pages) and 0 not in swa_pages
    assert a.available_size() + len(full_pages) * ps == a.size
    assert a.swa_available_size() + len(swa_pages) * ps == a.size_swa
    mapping = pool.full_to_swa_index_mapping.clone()
    if pool._pending_resets:  # deferred (overlapped decode): what the next step applies first
        mapping[torch.cat(pool._pending_resets)] = -1
    held = set()
    for r in reqs:
        assert r.swa_page_start == max(0, r.kv_len - W) // ps  # evicted up to the window
        n_tok = r.kv_len - r.swa_page_start * ps
        assert len(r.swa_pages) == -(-n_tok // ps)
        for t in range(r.swa_page_start * ps, r.kv_len):
            full = r.kv_pages[t // ps] * ps + t % ps
            swa = r.swa_pages[t // ps - r.swa_page_start] * ps + t % ps
            assert int(mapping[full]) == swa
            assert int(r2t.req_to_token[r.req_pool_idx, t]) == full
            assert int(r2t.req_to_swa_token[r.req_pool_idx, t]) == swa
            held.add(full)
    live = (mapping >= 0).nonzero().flatten().tolist()
    assert set(live) - set(range(ps)) == held  # every other full slot maps to -1


@settings(max_examples=40, deadline=None)
@given(
    ps=st.sampled_from([1, 4]),
    window=st.integers(1, 9),
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "decode", "finish"]), st.integers(1, 30)),
        min_size=1,
        max_size=40,
    ),
    defer=st.booleans(),
)
def test_random_lifecycles_are_exact(ps, window, ops, defer):
    """Random admissions, decode steps and finishes keep the pools and tables exact, with the
    evictions' mapping resets applied at once or deferred to the next decode step (`defer`,
    the overlapped decode's mode: checked as the mapping the next step's kernel leaves)."""
    size = 96
    size_swa = (6 * swa_tokens_per_request(window, ps) + 32) // ps * ps
    batch = _batch(size, size_swa, ps, window)
    batch.token_to_kv_pool.defer_mapping_resets = defer
    a = batch.allocator
    reqs: list[Req] = []
    for n, (op, x) in enumerate(ops):
        if op == "add":
            pages = -(-x // ps)
            if (
                batch.req_to_token_pool.available_size() == 0
                or a.available_size() < pages * ps
                or a.swa_available_size() < pages * ps
            ):
                continue
            r = Req(n, list(range(3, 3 + x)), SamplingParams(max_new_tokens=8))
            batch.prepare_for_extend([r])
            reqs.append(r)
        elif op == "decode" and reqs:
            new_pages = sum(1 for r in reqs if r.kv_len % ps == 0)
            if (
                any(r.kv_len + 1 > 90 for r in reqs)
                or a.available_size() < new_pages * ps
                or a.swa_available_size() < new_pages * ps
            ):
                continue
            for r in reqs:
                r.output_ids.append(5)
            fb = batch.prepare_for_decode(reqs)
            # the batch carries the new tokens' window slots (what the mapping says), as the
            # sixth row of its decode block: the graph replay gathers nothing
            pool = batch.token_to_kv_pool
            assert torch.equal(
                fb.out_cache_loc_swa, pool.translate_loc_from_full_to_swa(fb.out_cache_loc)
            )
            assert fb.decode_inputs.shape == (6, len(reqs))
            assert fb.out_cache_loc_swa.data_ptr() == fb.decode_inputs[5].data_ptr()
        elif op == "finish" and reqs:
            batch.free_req(reqs.pop(x % len(reqs)))
        batch.evict_swa(reqs)
        _check(batch, reqs)
    for r in reqs:
        batch.free_req(r)
    _check(batch, [])
    assert batch.req_to_token_pool.available_size() == batch.req_to_token_pool.size


def test_window_pool_full_gives_back_the_full_pages():
    batch = _batch(size=64, size_swa=8, ps=4, window=3)
    a = batch.allocator
    r = Req(0, list(range(3, 15)), SamplingParams(max_new_tokens=4))  # 12 tokens > 8 slots
    with pytest.raises(RuntimeError, match="out of memory"):
        batch.prepare_for_extend([r])
    assert a.available_size() == 64 and a.swa_available_size() == 8
    assert r.kv_pages == [] and r.swa_pages == [] and r.req_pool_idx is None
    with pytest.raises(ValueError, match="last_loc"):  # a bad window last_loc changes nothing
        a.alloc_decode(torch.tensor([2]), torch.tensor([4]), swa_last_loc=torch.tensor([3]))
    assert a.available_size() == 64 and a.swa_available_size() == 8


# ---------------------------------------------------------------------------- memory
GPT_OSS_20B = KVCacheShape(
    num_full_layers=12, num_swa_layers=12, head_num=8, head_dim=64, v_head_dim=64, elem_bytes=2
)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpt_oss_20b_hybrid_fits_1_8x_the_tokens_at_32k(page_size):
    """An H100's KV budget for gpt-oss-20b (80 GiB x 0.85 minus ~13 GiB of weights), 32k
    context, 256 request rows: the hybrid pool holds >= 1.8x the tokens of a uniform pool in
    the same bytes."""
    budget = int((80 * 0.85 - 13) * 2**30)
    rep = hybrid_token_capacity(budget, GPT_OSS_20B, 127, page_size, 256, 32768)
    assert rep.total_bytes <= budget
    uniform = budget // GPT_OSS_20B.uniform_bytes_per_token
    assert GPT_OSS_20B.full_bytes_per_token == 12 * 2048
    assert rep.max_total_num_tokens >= 1.8 * uniform, (rep.max_total_num_tokens, uniform)
    assert rep.token_ratio >= 1.8
    assert "hybrid" in rep.describe() and f"{rep.max_total_num_tokens} tokens" in rep.describe()


def test_memory_arithmetic():
    assert swa_tokens_per_request(127, 1) == 128  # W + 1 tokens
    assert swa_tokens_per_request(127, 16) == 9 * 16  # 128 unaligned tokens span 9 pages
    assert swa_tokens_per_request(4, 4) == 8
    assert swa_pool_size(4, 1, 3, 64) == 3 * 5 + 65
    shape = KVCacheShape(1, 2, 2, 8, 8, 4)
    rep = kv_memory_report(shape, 1, 100, 20)
    assert shape.full_bytes_per_token == 128 and shape.swa_bytes_per_token == 256
    assert rep.total_bytes == 101 * 128 + 21 * 256
    assert rep.uniform_max_total_num_tokens == rep.total_bytes // 384 - 1
    uni = kv_memory_report(KVCacheShape(3, 0, 2, 8, 8, 4), 1, 100)
    assert uni.total_bytes == 101 * 384 and uni.token_ratio == 1.0
    assert "uniform" in uni.describe()
    with pytest.raises(ValueError, match="no room"):
        hybrid_token_capacity(1000, shape, 4, 1, 3, 64)


def test_deferred_mapping_resets_wait_for_the_next_access():
    """With defer_mapping_resets, a reset waits on the host; take hands it over (requeue gives
    it back), any mapping access applies it first, clear drops it."""
    pool = _pool()
    pool.set_swa_mapping(torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3]))
    pool.defer_mapping_resets = True
    pool.reset_swa_mapping(torch.tensor([5, 6]))
    assert pool.full_to_swa_index_mapping[5:8].tolist() == [1, 2, 3]  # not yet
    taken = pool.take_mapping_resets()
    assert taken.tolist() == [5, 6] and pool.take_mapping_resets() is None
    pool.requeue_mapping_resets(taken)
    assert pool.translate_loc_from_full_to_swa(torch.tensor([5, 7, -1])).tolist() == [-1, 3, -1]
    pool.reset_swa_mapping(torch.tensor([7]))
    pool.set_swa_mapping(torch.tensor([8]), torch.tensor([4]))  # flushes first
    assert pool.full_to_swa_index_mapping[5:9].tolist() == [-1, -1, -1, 4]
    pool.reset_swa_mapping(torch.tensor([8]))
    pool.clear()
    assert pool.take_mapping_resets() is None


def test_deferred_reset_of_a_slot_handed_out_again_keeps_the_new_entry(monkeypatch):
    """A finished request's slots wait for their mapping reset; the allocator (a stack) hands
    the newest one out again at the next decode step, whose table kernel then writes its new
    window slot and is not given its reset (the kernel does not order the two)."""
    import srt.managers.schedule_batch as sb

    handed = []
    write = sb.write_decode_rows

    def spy(*args, **kw):
        extras = args[5]
        handed.append(None if extras.resets is None else extras.resets.tolist())
        return write(*args, **kw)

    monkeypatch.setattr(sb, "write_decode_rows", spy)
    batch = _batch(96, 40, 1, 3)
    pool = batch.token_to_kv_pool
    pool.defer_mapping_resets = True
    a, b = (Req(i, list(range(3, 9)), SamplingParams(max_new_tokens=8)) for i in range(2))
    batch.prepare_for_extend([a, b])
    for _ in range(3):
        for r in (a, b):
            r.output_ids.append(5)
        batch.prepare_for_decode([a, b])
        batch.evict_swa([a, b])
        _check(batch, [a, b])
    batch.free_req(a)
    pending = set(torch.cat(pool._pending_resets).tolist())
    b.output_ids.append(5)
    fb = batch.prepare_for_decode([b])
    new = int(fb.out_cache_loc[0])
    assert new in pending and not pool._pending_resets  # reused, and every reset applied
    assert sorted(handed[-1]) == sorted(pending - {new})
    assert int(pool.full_to_swa_index_mapping[new]) == int(fb.out_cache_loc_swa[0]) >= 0
    batch.evict_swa([b])
    _check(batch, [b])

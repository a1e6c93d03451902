"""MHATokenToKVPool and ReqToTokenPool: layouts, writes, fp8, errors, hygiene (CPU + GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import sgl_ext
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

# Runs the Triton kernels in the interpreter on CPU tensors (CI); on a CUDA machine the GPU tests
# cover the compiled kernels, and TRITON_INTERPRET is off there.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interpreter test")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def layer(i: int) -> SimpleNamespace:
    return SimpleNamespace(layer_id=i)


def make_pool(size=12, page_size=1, dtype=torch.bfloat16, heads=3, dim=8, layers=2, **kw):
    return MHATokenToKVPool(size, page_size, dtype, heads, dim, layers, "cpu", **kw)


def poison(pool: MHATokenToKVPool) -> None:
    """Fill every byte with 0x7F (a finite, distinctive value in every dtype)."""
    for b in pool.k_buffer + pool.v_buffer:
        b.view(torch.uint8).fill_(0x7F)


def slot_rows(buf: torch.Tensor, loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """buf rows of the given slots as [T, H, D]."""
    if buf.ndim == 3:
        return buf[loc]
    return buf[loc // page_size, loc % page_size]


def stored(x: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """Reference of what the cache holds for x: clamp(x / scale) in dtype (computed in float64)."""
    if dtype not in FP8:
        return x
    y = x.double() / (scale or 1.0)
    m = torch.finfo(dtype).max
    return y.clamp(-m, m).float().to(dtype)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_buffers_shapes_zero_and_views(page_size, cross, dtype):
    pool = make_pool(size=8, page_size=page_size, dtype=dtype, cross_layer_layout=cross)
    assert pool.num_slots == 8 + page_size
    store = torch.uint8 if dtype in FP8 else dtype
    assert pool.store_dtype == store
    for i in range(2):
        k, v = pool.get_kv_buffer(i)
        want = (9, 3, 8) if page_size == 1 else (3, page_size, 3, 8)
        assert tuple(k.shape) == want and tuple(v.shape) == want
        assert k.dtype == dtype and v.dtype == dtype
        assert k.stride(-1) == 1
        assert not k.view(torch.uint8).any() and not v.view(torch.uint8).any()  # zero-init
    lay = pool.get_layout()
    if cross:
        raw = pool.kv_buffer
        assert raw is not None and raw.dtype == store
        assert tuple(raw.shape) == (3 if page_size > 1 else 9, 2, 2, page_size, 3, 8)
        assert lay.kind == "cross_layer" and lay.shape == tuple(raw.shape)
        assert lay.dims == ("pages", "layers", "kv", "page_size", "heads", "head_dim")
        # layer 1's V view aliases raw[:, 1, 1]
        v1 = pool.get_value_buffer(1)
        assert v1.data_ptr() == raw[:, 1, 1].data_ptr()
    else:
        assert pool.kv_buffer is None and lay.kind == "layer_separate"


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize(
    "dtype,in_dtype,scale",
    [
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.float32, None),
        (torch.float8_e4m3fn, torch.bfloat16, 0.37),
        (torch.float8_e5m2, torch.float32, None),
    ],
)
def test_set_kv_buffer_writes_exactly_the_given_slots(page_size, cross, dtype, in_dtype, scale):
    torch.manual_seed(0)
    size, H, D = 9 * page_size, 3, 8
    pool = make_pool(size, page_size, dtype, H, D, 3, cross_layer_layout=cross)
    poison(pool)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    T = 7
    loc = torch.randperm(size, dtype=torch.int64)[:T] + page_size  # never the padding page
    loc[2] = -1  # skipped token
    k = torch.randn(T, H, D, dtype=in_dtype) * 3
    v = torch.randn(T, H * D, dtype=in_dtype) * 3  # 2-D value is accepted too
    k0, v0 = k.clone(), v.clone()
    ks = vs = scale
    pool.set_kv_buffer(layer(1), loc.to(torch.int32), k, v, ks, vs)
    assert torch.equal(k, k0) and torch.equal(v, v0)  # caller tensors untouched
    kb, vb = pool.get_kv_buffer(1)
    w = loc >= 0
    got_k = slot_rows(kb, loc[w], page_size)
    got_v = slot_rows(vb, loc[w], page_size)
    want_k = stored(k[w], dtype, ks)
    want_v = stored(v.view(T, H, D)[w], dtype, vs)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    # Every other byte (other slots, other layers, padding page) still holds the poison.
    kb_all = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    for i, (old, new) in enumerate(zip(before, kb_all, strict=True)):
        if i in (1, 4):  # layer 1's K and V (k_buffer + v_buffer lists, 3 layers)
            # clones are contiguous, so flat row = page * page_size + offset = slot
            rows_new, rows_old = new.reshape(-1, H, D).clone(), old.reshape(-1, H, D)
            rows_new[loc[w]] = rows_old[loc[w]]
            assert torch.equal(rows_new, rows_old)
        else:
            assert torch.equal(new, old)


def test_non_fp8_pool_ignores_scales_like_sglang():
    pool = make_pool(dtype=torch.float32)
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    pool.set_kv_buffer(layer(0), torch.tensor([1, 2]), k, v, k_scale=4.0, v_scale=0.5)
    assert torch.equal(pool.get_key_buffer(0)[1:3], k)
    assert torch.equal(pool.get_value_buffer(0)[1:3], v)


def test_start_layer_and_v_head_dim():
    pool = MHATokenToKVPool(5, 1, torch.float16, 2, 8, 2, "cpu", v_head_dim=4, start_layer=3)
    k, v = torch.randn(1, 2, 8, dtype=torch.float16), torch.randn(1, 2, 4, dtype=torch.float16)
    pool.set_kv_buffer(layer(4), torch.tensor([5]), k, v)
    assert torch.equal(pool.get_key_buffer(4)[5], k[0])
    assert torch.equal(pool.get_value_buffer(4)[5], v[0])
    assert tuple(pool.get_value_buffer(3).shape) == (6, 2, 4)
    with pytest.raises(ValueError, match="layer_id 2 out of range"):
        pool.get_key_buffer(2)
    with pytest.raises(ValueError, match="layer_id 5 out of range"):
        pool.set_kv_buffer(layer(5), torch.tensor([5]), k, v)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(TypeError, match="dtype"):
        make_pool(dtype=torch.int8)
    with pytest.raises(ValueError, match="multiple of page_size"):
        make_pool(size=10, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        make_pool(page_size=0)
    with pytest.raises(ValueError, match="cross_layer_layout"):
        MHATokenToKVPool(4, 1, torch.float16, 2, 8, 2, "cpu", v_head_dim=4, cross_layer_layout=True)
    pool = make_pool()
    k, v = torch.randn(3, 3, 8, dtype=torch.bfloat16), torch.randn(3, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="loc"):
        pool.set_kv_buffer(layer(0), torch.tensor([1, 2]), k, v)
    with pytest.raises(TypeError, match="pool dtype"):
        pool.set_kv_buffer(layer(0), torch.tensor([1, 2, 3]), k.float(), v.float())
    with pytest.raises(TypeError, match="layer_id must be an int"):
        pool.get_key_buffer("0")
    with pytest.raises(ValueError, match="head"):  # wrong head count, caught by sgl_ext's checks
        pool.set_kv_buffer(layer(0), torch.tensor([1, 2, 3]), k[:, :2], v[:, :2])
    assert not pool.get_key_buffer(0).any()  # nothing was written by the failed calls


@pytest.mark.parametrize("cross", [False, True])
def test_clear_and_zero_slots(cross):
    pool = make_pool(size=8, page_size=2, dtype=torch.float8_e4m3fn, cross_layer_layout=cross)
    poison(pool)
    pool.zero_slots(torch.tensor([3, 6]))
    for b in pool.k_buffer + pool.v_buffer:
        got = slot_rows(b.view(torch.uint8), torch.arange(10), 2)  # [slots, H, D]
        assert not got[[3, 6]].any()
        assert (got[[0, 1, 2, 4, 5, 7, 8, 9]] == 0x7F).all()
    pool.clear()
    assert all(not b.view(torch.uint8).any() for b in pool.k_buffer + pool.v_buffer)


def test_eager_never_forks_even_with_overlap_enabled():
    class Boom:
        def __getattr__(self, name):
            raise AssertionError(f"alt stream touched in eager mode ({name})")

    pool = make_pool(dtype=torch.float32, alt_stream=Boom())
    pool.set_stream_overlap(True)
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    pool.set_kv_buffer(layer(1), torch.tensor([4, 2]), k, v)
    assert torch.equal(pool.get_key_buffer(1)[[4, 2]], k)


@pytest.mark.parametrize("cross", [False, True])
def test_fused_rope_writes_into_pool_views(cross):
    """The pool's views are what the fused RoPE op receives; it must write through them."""
    torch.manual_seed(1)
    pool = make_pool(size=8, page_size=4, dtype=torch.float8_e4m3fn, cross_layer_layout=cross)
    T, H, D = 5, 3, 8
    q, k = torch.randn(T, 2 * H * D), torch.randn(T, H * D)
    v = torch.randn(T, H * D)
    cos_sin = torch.randn(16, D)
    pos = torch.randint(0, 16, (T,))
    loc = torch.tensor([4, 9, 5, -1, 11])
    kb, vb = pool.get_kv_buffer(1)
    arg = sgl_ext.FusedSetKVBufferArg(v, kb, vb, 0.5, None, loc)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cos_sin, True, arg)
    w = loc >= 0
    got_v = slot_rows(pool.get_value_buffer(1), loc[w], 4)
    got_k = slot_rows(pool.get_key_buffer(1), loc[w], 4)
    want_v = stored(v.view(T, H, D)[w], torch.float8_e4m3fn, None)
    want_k = stored(k.view(T, H, D)[w], torch.float8_e4m3fn, 0.5)
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert not pool.get_key_buffer(0).view(torch.uint8).any()  # other layer untouched


@interpreter_only
def test_set_kv_buffer_triton_backend_cross_layer(backend):
    backend("triton")
    torch.manual_seed(2)
    pool = make_pool(
        size=6, page_size=3, dtype=torch.bfloat16, heads=1, dim=16, cross_layer_layout=True
    )
    poison(pool)
    k = torch.randn(4, 1, 16, dtype=torch.bfloat16)
    v = torch.randn(4, 1, 16, dtype=torch.bfloat16)
    loc = torch.tensor([3, 8, -1, 4])
    pool.set_kv_buffer(layer(0), loc, k, v)
    w = loc >= 0
    assert torch.equal(slot_rows(pool.get_key_buffer(0), loc[w], 3), k[w])
    assert torch.equal(slot_rows(pool.get_value_buffer(0), loc[w], 3), v[w])
    assert (pool.get_key_buffer(1).view(torch.uint8) == 0x7F).all()


def test_req_to_token_pool():
    p = ReqToTokenPool(3, 7, "cpu")
    assert p.req_to_token.dtype == torch.int32 and tuple(p.req_to_token.shape) == (3, 7)
    a = p.alloc(2)
    assert a is not None and len(set(a)) == 2 and p.available_size() == 1
    assert p.alloc(2) is None
    p.write((a[0], slice(0, 3)), torch.tensor([5, 6, 7], dtype=torch.int32))
    p.free(a[0])
    assert not p.req_to_token[a[0]].any()  # freed rows hold no stale slots
    with pytest.raises(ValueError, match="freed twice"):
        p.free([a[0]])
    with pytest.raises(ValueError, match="out of range"):
        p.free(3)
    p.clear()
    assert p.available_size() == 3


def test_issue50_req_to_token_free_takes_only_ints_and_checks_before_mutating():
    """A tensor row and then the same row as an int was a double free the old set check
    missed (a tensor never equals an int in a set), so the row was handed out twice."""
    p = ReqToTokenPool(4, 5, "cpu")
    rows = p.alloc(4)
    assert rows == [0, 1, 2, 3]
    p.req_to_token.fill_(7)
    p.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="request slot 0 freed twice"):
        p.free([0])
    with pytest.raises(ValueError, match="request slot 0 freed twice"):
        p.free(torch.tensor(0, dtype=torch.int32))
    for bad in (1.0, True, [1, 2.0], torch.tensor([1.0]), torch.tensor([[1]]), "1", None):
        with pytest.raises(TypeError, match="free_index"):
            p.free(bad)
    with pytest.raises(ValueError, match="request slot 2 freed twice"):
        p.free([2, 2])  # listed twice in one call
    with pytest.raises(ValueError, match="request slot 4 out of range"):
        p.free((1, 4))
    # every rejected call left the pool as it was: only row 0 is free and zeroed
    assert p.free_slots == [0] and all(type(i) is int for i in p.free_slots)
    assert not p.req_to_token[0].any() and (p.req_to_token[1:] == 7).all()
    p.free(torch.tensor([1, 3]))
    got = p.alloc(3)
    assert got is not None and sorted(got) == [0, 1, 3] and p.alloc(1) is None
    with pytest.raises(ValueError, match="need_size"):
        p.alloc(True)


@pytest.mark.parametrize("page_size", [1, 2])
@pytest.mark.parametrize("cross", [False, True])
def test_issue50_zero_slots_skips_negative_and_out_of_range(page_size, cross):
    """zero_slots skips slots < 0 and >= num_slots as the KV write skips loc < 0; the old
    code zeroed the last real slot for -1 (and raised midway for a slot past the end)."""
    pool = make_pool(size=6, page_size=page_size, dtype=torch.float16, cross_layer_layout=cross)
    n = pool.num_slots
    poison(pool)
    pool.zero_slots(torch.tensor([-1, -n, n, n + 5, 2**40]))
    for b in pool.k_buffer + pool.v_buffer:
        assert (b.view(torch.uint8) == 0x7F).all()
    pool.zero_slots(torch.tensor([[-1, 3], [n, 5]], dtype=torch.int32))
    for b in pool.k_buffer + pool.v_buffer:
        got = slot_rows(b.view(torch.uint8), torch.arange(n), page_size)  # [slots, H, D]
        assert not got[[3, 5]].any()
        keep = [s for s in range(n) if s not in (3, 5)]
        assert (got[keep] == 0x7F).all()
    with pytest.raises(TypeError, match="indices"):
        pool.zero_slots(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="indices"):
        pool.zero_slots([1])


# ----------------------------------------------------------------------------- GPU
@needs_cuda
@pytest.mark.parametrize("cross", [False, True])
def test_issue50_zero_slots_device_indices_out_of_range_hit_only_padding(cross):
    """Device indices are not read on the host: entries < 0 or past the buffers zero padding
    slot 0 instead (no request reads it), never the last real slot or memory past it."""
    pool = MHATokenToKVPool(6, 2, torch.bfloat16, 3, 8, 2, "cuda", cross_layer_layout=cross)
    n = pool.num_slots
    poison(pool)
    pool.zero_slots(torch.tensor([-1, 3, n, -n - 1, 2**40], device="cuda"))
    for b in pool.k_buffer + pool.v_buffer:
        got = slot_rows(b.view(torch.uint8), torch.arange(n, device="cuda"), 2)
        assert not got[[0, 3]].any()
        assert (got[[s for s in range(n) if s not in (0, 3)]] == 0x7F).all()


def _load_stream_check():
    from tests.srt.mem_cache import gpu_stream_check

    return gpu_stream_check


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_overlap_readers_see_new_values_1000_replays(page_size):
    run_check = _load_stream_check().run_check
    assert run_check(page_size=page_size, replays=1000, dtype=torch.bfloat16) == 0
    assert run_check(page_size=page_size, replays=200, dtype=torch.float8_e4m3fn) == 0


@needs_cuda
def test_graph_overlap_actually_forks():
    """Under capture with overlap on, the V write runs on alt_stream (graph has a fork)."""
    alt = torch.cuda.Stream()
    pool = MHATokenToKVPool(64, 1, torch.float16, 2, 64, 1, "cuda", alt_stream=alt)
    pool.set_stream_overlap(True)
    calls = []
    orig = torch.cuda.stream

    def spy(s):
        calls.append(s)
        return orig(s)

    k = torch.randn(4, 2, 64, device="cuda", dtype=torch.float16)
    loc = torch.arange(1, 5, device="cuda")
    g = torch.cuda.CUDAGraph()
    pool.set_kv_buffer(layer(0), loc, k, k)  # warm-up, eager
    torch.cuda.synchronize()
    torch.cuda.stream = spy
    try:
        with torch.cuda.graph(g):
            pool.set_kv_buffer(layer(0), loc, k, k)
    finally:
        torch.cuda.stream = orig
    assert any(s == alt for s in calls)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize(
    "dtype,scale",
    [(torch.bfloat16, None), (torch.float8_e4m3fn, 0.37), (torch.float8_e5m2, "tensor")],
)
def test_stream_split_write_matches_single_kernel_bits(page_size, cross, dtype, scale):
    """The per-side write used for K and V under graph capture stores the same bytes as
    sgl_ext.set_kv_buffer (run here on CPU: it is device-agnostic torch)."""
    torch.manual_seed(4)
    if scale == "tensor":
        scale = torch.tensor([1.7])
    a = make_pool(size=8 * page_size, page_size=page_size, dtype=dtype, cross_layer_layout=cross)
    b = make_pool(size=8 * page_size, page_size=page_size, dtype=dtype, cross_layer_layout=cross)
    poison(a)
    poison(b)
    T = 7
    loc = torch.randperm(8 * page_size)[:T] + page_size
    loc[3] = -1
    k = torch.randn(T, 3, 8, dtype=torch.bfloat16) * 50  # some values saturate fp8
    v = torch.randn(T, 3, 8, dtype=torch.bfloat16) * 50
    a.set_kv_buffer(layer(1), loc, k, v, scale, scale)
    b._scatter_rows(b.k_buffer[1], loc, k, scale)
    b._scatter_rows(b.v_buffer[1], loc, v, scale)
    for x, y in zip(a.k_buffer + a.v_buffer, b.k_buffer + b.v_buffer, strict=True):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_stream_split_write_is_sync_free():
    """No data-dependent host read (.item(), nonzero, ...) that would break graph capture:
    under FakeTensorMode any such read raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        pool = make_pool(size=8, page_size=4, dtype=torch.float8_e4m3fn)
        loc = torch.tensor([4, -1, 9])
        rows = torch.randn(3, 3, 8)
        pool._scatter_rows(pool.k_buffer[0], loc, rows, torch.ones(1))
        pool._scatter_rows(pool.v_buffer[0], loc, rows, 0.5)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_graph_overlapped_write_equals_eager_kernel_bits(dtype):
    torch.manual_seed(7)
    eager = MHATokenToKVPool(64, 16, dtype, 2, 64, 2, "cuda", cross_layer_layout=True)
    graphed = MHATokenToKVPool(
        64, 16, dtype, 2, 64, 2, "cuda", cross_layer_layout=True, alt_stream=torch.cuda.Stream()
    )
    graphed.set_stream_overlap(True)
    scale = torch.full((1,), 0.3, device="cuda") if dtype in FP8 else None
    k = torch.randn(9, 2, 64, device="cuda", dtype=torch.bfloat16) * 100
    v = torch.randn(9, 2, 64, device="cuda", dtype=torch.bfloat16) * 100
    loc = torch.randperm(64, device="cuda")[:9] + 16
    loc[4] = -1
    eager.set_kv_buffer(layer(1), loc, k, v, scale, scale)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed.set_kv_buffer(layer(1), loc, k, v, scale, scale)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager.kv_buffer, graphed.kv_buffer)

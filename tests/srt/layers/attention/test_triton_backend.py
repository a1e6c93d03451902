"""TritonAttnBackend (our kernels) against the float64 reference; TRITON_INTERPRET=1 on CPU.

The interpreter is slow: a representative handful of tiny cases.
"""

import pytest
import torch

from tests.srt.layers.attention.attn_reference import run_scenario

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _backend(num_kv_splits=None):
    from srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(None, DEV, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize(
    "kw",
    [
        dict(page_size=1),
        dict(page_size=4, save_kv=False, hq=7, hkv=1),
        dict(page_size=16, window=3, use_sinks=True, pool_kw=dict(cross_layer_layout=True)),
        dict(cap=5.0, hq=3, hkv=3, d=8),
        dict(page_size=4, kv_dtype=torch.float8_e4m3fn, scale=0.5),
        dict(kv_dtype=torch.float8_e5m2, scale="tensor", use_sinks=True),
        dict(dtype=torch.bfloat16, kv_dtype=torch.bfloat16, page_size=16, window=5, hq=8),
    ],
)
def test_triton_backend(kw):
    if kw.get("scale") == "tensor":
        kw = {**kw, "scale": torch.tensor([0.25], device=DEV)}
    run_scenario(_backend, device=DEV, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(page_size=4, hq=8, hkv=2, use_sinks=True),
        dict(window=3, cap=5.0, hq=3, hkv=1, kv_dtype=torch.float8_e4m3fn, scale=0.5),
    ],
)
def test_triton_backend_split_kv(kw):
    """Flash-decoding (4 KV chunks per request + the merge kernel) on the shared scenario."""
    run_scenario(lambda: _backend(num_kv_splits=4), device=DEV, **kw)


@pytest.mark.parametrize(
    "splits, window, sinks, cap, page_size, dtype",
    [
        (1, -1, True, 0.0, 1, torch.float32),
        (2, -1, False, 0.0, 16, torch.float32),
        (16, 100, True, 0.0, 4, torch.float32),
        (4, -1, False, 3.0, 1, torch.float32),
        (8, -1, True, 0.0, 1, torch.bfloat16),  # 16-bit tensor-core dots on the GPU
        (1, 40, False, 0.0, 4, torch.bfloat16),
        # windows over 2 and 3 tiles, all loaded before the PDL wait (pre_tiles 2 / 3)
        (1, 100, False, 2.0, 1, torch.float32),
        (1, 130, True, 0.0, 4, torch.bfloat16),
    ],
)
def test_decode_split_kv_long_sequences(splits, window, sinks, cap, page_size, dtype):
    """Decode over 2, 33 and 257 cached keys (chunks of unequal fill, empty chunks, windows that
    start mid-chunk) against the float64 reference; the output is poisoned first."""
    from srt.layers.radix_attention import RadixAttention
    from tests.srt.layers.attention.attn_reference import ref_attention
    from tests.srt.models.fb_harness import Harness, make_kv_pool

    g = torch.Generator().manual_seed(splits)
    hq, hkv, d, lens = 4, 2, 16, [257, 2, 33]
    pool = make_kv_pool(512, page_size, dtype, hkv, d, 1, DEV)
    be = _backend(num_kv_splits=splits)
    h = Harness(pool, be, max_reqs=4, max_ctx=300, device=DEV)
    sink = torch.randn(hq, generator=g).to(DEV) if sinks else None
    layer = RadixAttention(
        hq, d, d**-0.5, hkv, 0, sliding_window_size=window, logit_cap=cap, sinks=sink
    )
    rows = [3, 0, 1]
    fb = h.extend(rows, [[1] * (n - 1) for n in lens])
    k_hist = torch.randn(sum(lens) - 3, hkv, d, generator=g).to(DEV, dtype)
    v_hist = torch.randn(sum(lens) - 3, hkv, d, generator=g).to(DEV, dtype)
    pool.set_kv_buffer(layer, fb.out_cache_loc, k_hist, v_hist)
    fb = h.decode(rows, [2, 2, 2])
    q = torch.randn(3, hq * d, generator=g).to(DEV, dtype)
    k = torch.randn(3, hkv * d, generator=g).to(DEV, dtype)
    v = torch.randn(3, hkv * d, generator=g).to(DEV, dtype)
    out = layer(q, k, v, fb)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    start = 0
    for i, n in enumerate(lens):
        kk = torch.cat([k_hist[start : start + n - 1].cpu(), k[i].view(1, hkv, d).cpu()])
        vv = torch.cat([v_hist[start : start + n - 1].cpu(), v[i].view(1, hkv, d).cpu()])
        start += n - 1
        ref = ref_attention(
            q[i].view(1, hq, d).cpu(),
            kk,
            vv,
            torch.tensor([n - 1]),
            d**-0.5,
            window,
            cap,
            None if sink is None else sink.cpu(),
        )
        got = out[i].view(1, hq, d).cpu().double()
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


def test_num_kv_splits_same_for_graph_bucket_and_eager_batch():
    """A CUDA-graph bucket and every batch size it serves choose the same split count."""
    from srt.layers.attention.triton_ops.decode_attention import MAX_KV_SPLITS, num_kv_splits
    from srt.model_executor.cuda_graph_runner import get_batch_sizes_to_capture

    buckets = get_batch_sizes_to_capture(160)
    for sms in (132, 78):
        for hkv in (1, 2, 8):
            for raw in range(1, 161):
                b = next(x for x in buckets if x >= raw)
                s = num_kv_splits(raw, hkv, sms)
                assert s == num_kv_splits(b, hkv, sms)
                assert 1 <= s <= MAX_KV_SPLITS and s & (s - 1) == 0
    assert num_kv_splits(1, 8, 132) == 16 and num_kv_splits(64, 8, 132) == 1


def test_pre_tiles_cover_short_windows_at_small_batches():
    from srt.layers.attention.triton_ops.decode_attention import pre_tiles

    assert pre_tiles(1, 1, 128, 64) == 3 and pre_tiles(8, 1, 100, 64) == 2
    assert pre_tiles(1, 1, 40, 64) == 1 and pre_tiles(1, 1, -1, 64) == 1  # one tile; no window
    assert pre_tiles(16, 1, 128, 64) == 1 and pre_tiles(1, 4, 128, 64) == 1  # batch 16; splits
    assert pre_tiles(1, 1, 1000, 64) == 3


def test_num_kv_splits_short_window_takes_one_program():
    """A sliding window of fewer than WINDOW_ONE_SPLIT_KEYS keys runs unsplit (no merge kernel);
    longer windows and full attention split as before."""
    from srt.layers.attention.triton_ops.decode_attention import (
        WINDOW_ONE_SPLIT_KEYS,
        num_kv_splits,
    )

    for b in (1, 7, 64):
        assert num_kv_splits(b, 8, 132, window=0) == 1
        assert num_kv_splits(b, 8, 132, window=WINDOW_ONE_SPLIT_KEYS - 1) == 1
        for w in (WINDOW_ONE_SPLIT_KEYS, 4096, -1):
            assert num_kv_splits(b, 8, 132, window=w) == num_kv_splits(b, 8, 132)
    assert num_kv_splits(1, 8, 132, window=127) == 1  # gpt-oss's sliding layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["triton", "native"])
def test_decode_cuda_graph_replay_equals_eager(name):
    """Capture one decode attention, replay it for a later step (new q, longer sequences, new
    cache contents): the same bits as eager, with no host sync inside the captured region."""
    from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from srt.layers.attention.triton_backend import TritonAttnBackend
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardMode
    from tests.srt.models.fb_harness import Harness, make_kv_pool

    cls = TritonAttnBackend if name == "triton" else TorchNativeAttnBackend
    dev, hq, hkv, d = "cuda", 4, 2, 64
    pool = make_kv_pool(512, 16, torch.bfloat16, hkv, d, 1, dev)
    be = cls(None, dev)
    h = Harness(pool, be, max_reqs=4, max_ctx=128, device=dev)
    sinks = torch.randn(hq, device=dev)
    layer = RadixAttention(hq, d, d**-0.5, hkv, 0, sliding_window_size=20, sinks=sinks)
    rows = [1, 3]

    def kv(n):
        return (torch.randn(n, hkv * d, device=dev, dtype=torch.bfloat16) for _ in range(2))

    fb = h.extend(rows, [[1] * 33, [2] * 7])
    k, v = kv(40)
    pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
    fb = h.decode(rows, [3, 4])
    k, v = kv(2)
    pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
    q_static = torch.randn(2, hq * d, device=dev, dtype=torch.bfloat16)
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    be.init_forward_metadata_capture_cuda_graph(
        2, 2, fb.req_pool_indices, fb.seq_lens, ForwardMode.DECODE
    )
    layer(q_static, None, None, fb, save_kv_cache=False)  # warm up (compile) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = layer(q_static, None, None, fb, save_kv_cache=False)
    for _ in range(3):
        fb = h.decode(rows, [5, 6])
        k, v = kv(2)
        pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        q_static.copy_(torch.randn_like(q_static))
        rpi, sl, total = fb.req_pool_indices, fb.seq_lens, fb.seq_lens_sum
        be.init_forward_metadata_replay_cuda_graph(2, rpi, sl, total, ForwardMode.DECODE, None)
        graph.replay()
        be.init_forward_metadata(fb)
        eager = layer(q_static, None, None, fb, save_kv_cache=False)
        torch.cuda.synchronize()
        assert torch.equal(out_static, eager)


def test_short_windows_take_one_wide_tile_at_small_batches():
    """A window of up to WIDE_TILE_KEYS keys, unsplit, at up to WIDE_WINDOW_BATCH requests is
    one tile (loaded before the PDL wait); everything else keeps the 64-key tiles."""
    from srt.layers.attention.triton_ops.decode_attention import decode_config, pre_tiles

    wide = decode_config(1, 1, 64, 128)
    assert wide.block_n == 256 and pre_tiles(1, 1, 128, wide.block_n) == 1
    assert decode_config(8, 1, 64, 100).block_n == 128 and decode_config(1, 1, 64, 40).block_n == 64
    for b, splits, window in ((16, 1, 128), (1, 4, 128), (1, 1, 256), (1, 1, -1)):
        assert decode_config(b, splits, 64, window).block_n == 64


@pytest.mark.parametrize(
    "splits, window, sinks, cap, page_size, dtype",
    [
        (2, -1, False, 0.0, 1, torch.float32),
        (4, -1, True, 0.0, 16, torch.float32),
        (8, 6, True, 3.0, 4, torch.float32),
        (4, -1, False, 0.0, 1, torch.bfloat16),
    ],
)
def test_extend_split_kv_equals_one_program_per_block(splits, window, sinks, cap, page_size, dtype):
    """Split-KV extend (a short chunk after a long cached prefix): each block's keys cut into
    chunks, merged with the sinks, equals the single-program kernel and the float64 reference
    (prefixes 131 / 0 / 40, new tokens 7 / 1 / 33); the output is poisoned first."""
    from srt.layers.attention.triton_backend import kv_args
    from srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
    from srt.layers.radix_attention import RadixAttention
    from tests.srt.layers.attention.attn_reference import ref_attention
    from tests.srt.models.fb_harness import Harness, make_kv_pool

    g = torch.Generator().manual_seed(splits + page_size)
    hq, hkv, d = 4, 2, 16
    prefix, new = [131, 0, 40], [7, 1, 33]
    pool = make_kv_pool(512, page_size, dtype, hkv, d, 1, DEV)
    h = Harness(pool, _backend(), max_reqs=4, max_ctx=300, device=DEV)
    sink = torch.randn(hq, generator=g).to(DEV) if sinks else None
    layer = RadixAttention(
        hq, d, d**-0.5, hkv, 0, sliding_window_size=window, logit_cap=cap, sinks=sink
    )
    rows = [2, 0, 3]
    lens = [p + n for p, n in zip(prefix, new, strict=True)]
    keys = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    vals = [torch.randn(n, hkv, d, generator=g).to(dtype) for n in lens]
    have = [i for i, p in enumerate(prefix) if p]
    fb = h.extend([rows[i] for i in have], [[1] * prefix[i] for i in have])
    k_pre = torch.cat([keys[i][: prefix[i]] for i in have]).to(DEV)
    v_pre = torch.cat([vals[i][: prefix[i]] for i in have]).to(DEV)
    pool.set_kv_buffer(layer, fb.out_cache_loc, k_pre, v_pre)
    fb = h.extend(rows, [[1] * n for n in new])
    k_new = torch.cat([keys[i][prefix[i] :] for i in range(3)]).to(DEV)
    v_new = torch.cat([vals[i][prefix[i] :] for i in range(3)]).to(DEV)
    pool.set_kv_buffer(layer, fb.out_cache_loc, k_new, v_new)
    q = torch.randn(sum(new), hq, d, generator=g).to(DEV, dtype)
    kv = kv_args(layer, fb)
    r2t = fb.req_to_token_pool.req_to_token
    args = (fb.req_pool_indices, fb.extend_seq_lens, fb.extend_prefix_lens, fb.extend_start_loc)
    outs = []
    for s in (1, splits):
        o = torch.full((sum(new), hq, d), float("nan"), dtype=dtype, device=DEV)
        extend_attention_fwd(
            q, o, r2t, *args, max(new), d**-0.5, kv, sink, window, cap, num_splits=s
        )
        outs.append(o.cpu().double())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1], outs[0], atol=tol, rtol=tol)
    t0 = 0
    for i in range(3):
        pos = torch.arange(prefix[i], prefix[i] + new[i])
        ref = ref_attention(
            q[t0 : t0 + new[i]].cpu(),
            keys[i],
            vals[i],
            pos,
            d**-0.5,
            window,
            cap,
            None if sink is None else sink.cpu(),
        )
        got = outs[1][t0 : t0 + new[i]]
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
        t0 += new[i]


def test_extend_num_splits_few_programs_over_long_keys(monkeypatch):
    """Split-KV extend is chosen only where the programs are few and the keys long: Llama-3-8B
    heads on 132 SMs split 128 new tokens after 32K keys 4 ways, not 512 tokens or short keys."""
    from srt.layers.attention.triton_ops import extend_attention as ea

    monkeypatch.setattr(ea, "interpreting", lambda: False)  # the GPU's tile shape
    assert ea.extend_num_splits(1, 8, 4, 128, 32768 + 128, 132) == 4
    assert ea.extend_num_splits(1, 8, 4, 128, 8192 + 128, 132) == 4
    assert ea.extend_num_splits(1, 8, 4, 512, 32768 + 512, 132) == 1
    assert ea.extend_num_splits(1, 8, 4, 128, 1500, 132) == 1  # too few keys per chunk
    assert ea.extend_num_splits(32, 8, 4, 128, 32768, 132) == 1  # programs enough
    assert ea.extend_num_splits(1, 1, 1, 1, 10**6, 132) == ea.MAX_EXTEND_SPLITS == 4
    assert ea.extend_num_splits(1, 8, 4, 128, 32768, 1) == 1


@pytest.mark.parametrize("kw", [dict(page_size=4, use_sinks=True), dict(window=3, cap=5.0)])
def test_backend_extend_takes_the_split_it_chooses(monkeypatch, kw):
    """The backend's extend launches the chosen split (forced here with a tiny key minimum and
    many SMs) and still matches the float64 reference on the shared scenario."""
    from srt.layers.attention import triton_backend as tb
    from srt.layers.attention.triton_ops import extend_attention as ea

    monkeypatch.setattr(ea, "MIN_SPLIT_KEYS", 2)
    seen = []
    fwd = tb.extend_attention_fwd

    def spy(*a, **k):
        seen.append(k["num_splits"])
        return fwd(*a, **k)

    monkeypatch.setattr(tb, "extend_attention_fwd", spy)

    def make():
        b = _backend()
        b._num_sms = 1000
        return b

    run_scenario(make, device=DEV, **kw)
    assert max(seen) > 1

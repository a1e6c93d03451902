"""TorchNativeAttnBackend against a float64 reference (GQA, window, sinks, pages, fp8)."""

import pytest
import torch

from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from tests.srt.layers.attention.attn_reference import run_scenario


def _backend():
    return TorchNativeAttnBackend(None, "cpu")


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("save_kv", [True, False])
def test_native_basic(page_size, save_kv):
    run_scenario(_backend, page_size=page_size, save_kv=save_kv)


@pytest.mark.parametrize(
    "kw",
    [
        dict(window=3),
        dict(use_sinks=True),
        dict(use_sinks=True, window=2, page_size=4),
        dict(cap=5.0),
        dict(hq=7, hkv=1),
        dict(hq=3, hkv=3, d=8),
        dict(page_size=4, pool_kw=dict(cross_layer_layout=True)),  # strided per-layer views
        dict(page_size=1, pool_kw=dict(cross_layer_layout=True), kv_dtype=torch.float8_e4m3fn),
    ],
)
def test_native_features(kw):
    run_scenario(_backend, **kw)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [None, 0.5, "tensor"])
def test_native_fp8(kv_dtype, scale):
    if scale == "tensor":
        scale = torch.tensor([0.25])
    run_scenario(_backend, kv_dtype=kv_dtype, scale=scale, page_size=4)


def test_native_bf16():
    run_scenario(_backend, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, use_sinks=True)


def test_decode_width_is_fixed_so_eager_equals_graph():
    """Decode gathers the full req_to_token row whatever seq_lens_cpu says, so eager decode and a
    graph replay (fixed width) reduce over the same shape: identical bits."""
    from srt.layers.radix_attention import RadixAttention
    from tests.srt.models.fb_harness import Harness, make_kv_pool

    pool = make_kv_pool(64, 1, torch.float32, 1, 8, 1, "cpu")
    be = _backend()
    h = Harness(pool, be, max_reqs=2, max_ctx=16)
    layer = RadixAttention(2, 8, 0.3, 1, 0)
    fb = h.extend([1], [[5, 6, 7]])
    q, k, v = torch.randn(3, 16), torch.randn(3, 8), torch.randn(3, 8)
    layer(q, k, v, fb)
    fb = h.decode([1], [8])
    assert be.forward_metadata.max_len == 16
    q1, k1, v1 = torch.randn(1, 16), torch.randn(1, 8), torch.randn(1, 8)
    out = layer(q1, k1, v1, fb)
    kk, vv = torch.cat([k, k1]), torch.cat([v, v1])
    s = (q1.view(2, 8) @ kk.T) * 0.3  # [2 heads, 4 keys]
    ref = (torch.softmax(s, -1) @ vv).view(1, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the graph path: the metadata reads the capture's buffers (here fb's); a replay with the
    # same buffers copies nothing, one with other tensors copies them in
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    be.init_forward_metadata_capture_cuda_graph(
        1, 1, fb.req_pool_indices, fb.seq_lens, fb.forward_mode
    )
    out_g = layer(q1, None, None, fb, save_kv_cache=False)
    assert torch.equal(out_g, out)
    meta = be.forward_metadata
    assert meta.req_pool_indices.data_ptr() == fb.req_pool_indices.data_ptr()
    assert meta.seq_lens.data_ptr() == fb.seq_lens.data_ptr()
    be.init_forward_metadata_replay_cuda_graph(
        1, fb.req_pool_indices, fb.seq_lens, 4, fb.forward_mode, None
    )
    assert be.forward_metadata is meta
    rpi, sl = torch.zeros_like(fb.req_pool_indices), torch.full_like(fb.seq_lens, 2)
    be.init_forward_metadata_replay_cuda_graph(1, rpi, sl, 2, fb.forward_mode, None)
    assert be.forward_metadata is meta and meta.seq_lens.tolist() == [2]
    assert fb.req_pool_indices.tolist() == [0]  # copied into the captured buffers
    # a batch size never captured: init_cuda_graph_state's buffers
    be.init_forward_metadata_replay_cuda_graph(
        2, rpi.repeat(2), sl.repeat(2), 4, fb.forward_mode, None
    )
    g = be.cuda_graph_metadata
    assert be.forward_metadata.seq_lens.data_ptr() == g.seq_lens.data_ptr()
    assert g.seq_lens[:2].tolist() == [2, 2]

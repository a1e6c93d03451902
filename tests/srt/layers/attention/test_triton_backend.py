"""TritonAttnBackend (our kernels) against the float64 reference; TRITON_INTERPRET=1 on CPU.

The interpreter is slow: a representative handful of tiny cases.
"""

import pytest
import torch

from tests.srt.layers.attention.attn_reference import run_scenario

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _backend():
    from srt.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(None, DEV)


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

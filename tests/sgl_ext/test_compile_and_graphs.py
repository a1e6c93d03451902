"""torch.compile (fullgraph) and CUDA-graph capture through the fused ops: RoPE + KV write, and
the q/k-norm + RoPE + KV write op."""

from __future__ import annotations

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from tests.sgl_ext.sgl_ext_testutil import make_cos_sin_cache
from tests.sgl_ext.test_qk_norm_rope import EPS as QK_EPS
from tests.sgl_ext.test_qk_norm_rope import _inputs as qk_inputs

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _layer_step(pos, qkv, cs, kb, vb, loc, ks, vs, hq, hkv, d):
    """What an attention layer does: split qkv, rope + fused KV write, use the result."""
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views of qkv
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, True, arg)
    return (q * 2).sum(-1) + k.float().sum(-1)


def _assert_same_writes(qkv, kb, vb, e_qkv, e_kb, e_vb):
    """The run under test wrote exactly what the eager reference (e_*) did: q/k in place in qkv,
    and the K / V cache bytes."""
    assert torch.equal(qkv, e_qkv)
    assert torch.equal(kb.view(torch.uint8), e_kb.view(torch.uint8))
    assert torch.equal(vb.view(torch.uint8), e_vb.view(torch.uint8))


def _inputs(device, t=6, hq=4, hkv=2, d=16, kv_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 64, (t,), generator=g).to(device)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).bfloat16().to(device)
    kb = torch.zeros(4, 8, hkv, d, device=device, dtype=kv_dtype)  # paged [P, ps, H, D]
    vb = torch.zeros_like(kb)
    loc = torch.randperm(32, generator=g)[:t].to(device)
    loc[0] = -1
    return pos, qkv, kb, vb, loc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_compile_fullgraph_matches_eager(backend, device, kv_dtype):
    if device == "cpu":
        backend("native")
    torch._dynamo.reset()
    hq, hkv, d = 4, 2, 16
    cs = make_cos_sin_cache(64, d).to(device)
    ks = torch.tensor(0.5, device=device)
    compiled = torch.compile(_layer_step, fullgraph=True, dynamic=False)
    for seed in range(2):
        pos, qkv, kb, vb, loc = _inputs(device, kv_dtype=kv_dtype, seed=seed)
        e_qkv, e_kb, e_vb = qkv.clone(), kb.clone(), vb.clone()
        out_e = _layer_step(pos, e_qkv, cs, e_kb, e_vb, loc, ks, 2.0, hq, hkv, d)
        out_c = compiled(pos, qkv, cs, kb, vb, loc, ks, 2.0, hq, hkv, d)
        torch.testing.assert_close(out_c, out_e)
        _assert_same_writes(qkv, kb, vb, e_qkv, e_kb, e_vb)
        assert kb.view(torch.uint8).any()


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_graph_replay_with_new_positions_slots_and_scales(backend, kv_dtype):
    """Capture once; between replays change positions, slots and scale tensors in place."""
    backend("triton")
    hq, hkv, d, t = 8, 2, 64, 5
    cs = make_cos_sin_cache(256, d).cuda()
    pos, qkv, kb, vb, loc = _inputs("cuda", t, hq, hkv, d, kv_dtype)
    ks = torch.tensor([0.5], device="cuda")
    vs = torch.tensor([2.0], device="cuda")
    static_qkv = qkv.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compile) outside the graph
        _layer_step(pos, static_qkv.clone(), cs, kb.clone(), vb.clone(), loc, ks, vs, hq, hkv, d)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _layer_step(pos, static_qkv, cs, kb, vb, loc, ks, vs, hq, hkv, d)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        new_qkv = torch.randn(qkv.shape, generator=g).bfloat16().cuda()
        static_qkv.copy_(new_qkv)
        pos.copy_(torch.randint(0, 256, (t,), generator=g))
        new_loc = torch.randperm(32, generator=g)[:t]
        new_loc[step % t] = -1
        loc.copy_(new_loc)
        ks.fill_(0.25 + step)
        vs.fill_(1.0 / (step + 1))
        e_qkv, e_kb, e_vb = new_qkv.clone(), kb.clone(), vb.clone()
        _layer_step(pos, e_qkv, cs, e_kb, e_vb, loc, ks, vs, hq, hkv, d)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_writes(static_qkv, kb, vb, e_qkv, e_kb, e_vb)


@gpu
@pytest.mark.parametrize(
    "kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("neox", [True, False])
def test_backends_agree_on_cuda(backend, kv_dtype, neox):
    """native and triton on CUDA: V copies bit-identical; q/k within one rounding step."""
    dtype = torch.float16 if kv_dtype == torch.float16 else torch.bfloat16
    hq, hkv, d, t = 32, 8, 128, 257
    g = torch.Generator().manual_seed(5)
    pos = torch.randint(0, 4096, (t,), generator=g).cuda()
    cs = make_cos_sin_cache(4096, d).cuda()
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).cuda()
    loc = torch.randperm(1024, generator=g)[:t].cuda()
    loc[::7] = -1
    outs = {}
    for name in ("native", "triton"):
        backend(name)
        x = qkv.clone()
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        kraw = torch.full((64, hkv, 16, d), float("nan"), device="cuda").to(kv_dtype)  # HND
        vraw = torch.full_like(kraw, float("nan"))
        kb, vb = kraw.permute(0, 2, 1, 3), vraw.permute(0, 2, 1, 3)
        arg = FusedSetKVBufferArg(v, kb, vb, torch.tensor(0.7, device="cuda"), 1.3, loc)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, neox, arg)
        outs[name] = (q.float(), k.float(), kraw.view(torch.uint8), vraw.view(torch.uint8))
    qn, kn, kbn, vbn = outs["native"]
    qt, kt, kbt, vbt = outs["triton"]
    torch.testing.assert_close(qt, qn, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(kt, kn, atol=2e-2, rtol=1e-2)
    assert torch.equal(vbt, vbn)
    # K cache may differ only where the rotated key itself rounded differently.
    same = (kt == kn).all(-1)  # [T, Hkv] heads whose rotated key is bit-equal
    kbt_rows, kbn_rows = kbt.permute(0, 2, 1, 3), kbn.permute(0, 2, 1, 3)  # [P, ps, H, D]
    for i in range(t):
        s = int(loc[i])
        if s >= 0:
            got, want = kbt_rows[s // 16, s % 16], kbn_rows[s // 16, s % 16]  # [H, D]
            assert torch.equal(got[same[i]], want[same[i]])


# ------------------------------- the q/k-norm op (apply_qk_norm_rope_with_cos_sin_cache_inplace)
def _qk_layer_step(pos, qkv, cs, qw, kw, kb, vb, loc, ks, vs, hq, hkv, d):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views of qkv
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc)
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
        pos, q, k, d, cs, qw, kw, QK_EPS, True, arg
    )
    return (q * 2).sum(-1) + k.float().sum(-1)


def _qk_graph_inputs(device, t=6, hq=4, hkv=2, d=16, kv_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 64, (t,), generator=g).to(device)
    qkv, qw, kw = qk_inputs(g, t, hq, hkv, d, d, torch.bfloat16)
    kb = torch.zeros(4, 8, hkv, d, device=device, dtype=kv_dtype)  # paged [P, ps, H, D]
    loc = torch.randperm(32, generator=g)[:t].to(device)
    loc[0] = -1
    return pos, qkv.to(device), qw.to(device), kw.to(device), kb, torch.zeros_like(kb), loc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_qk_norm_compile_fullgraph_matches_eager(backend, device, kv_dtype):
    if device == "cpu":
        backend("native")
    torch._dynamo.reset()
    hq, hkv, d = 4, 2, 16
    cs = make_cos_sin_cache(64, d).to(device)
    ks = torch.tensor(0.5, device=device)
    compiled = torch.compile(_qk_layer_step, fullgraph=True, dynamic=False)
    for seed in range(2):
        pos, qkv, qw, kw, kb, vb, loc = _qk_graph_inputs(device, kv_dtype=kv_dtype, seed=seed)
        e_qkv, e_kb, e_vb = qkv.clone(), kb.clone(), vb.clone()
        out_e = _qk_layer_step(pos, e_qkv, cs, qw, kw, e_kb, e_vb, loc, ks, 2.0, hq, hkv, d)
        out_c = compiled(pos, qkv, cs, qw, kw, kb, vb, loc, ks, 2.0, hq, hkv, d)
        torch.testing.assert_close(out_c, out_e)
        _assert_same_writes(qkv, kb, vb, e_qkv, e_kb, e_vb)
        assert kb.view(torch.uint8).any()


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_qk_norm_cuda_graph_replay_with_new_inputs(backend, kv_dtype):
    """Capture once; between replays change qkv, positions, slots, scales and norm weights."""
    backend("triton")
    hq, hkv, d, t = 8, 2, 128, 5
    cs = make_cos_sin_cache(256, d).cuda()
    pos, qkv, qw, kw, kb, vb, loc = _qk_graph_inputs("cuda", t, hq, hkv, d, kv_dtype)
    ks, vs = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")
    static_qkv = qkv.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compile) outside the graph
        _qk_layer_step(
            pos, qkv.clone(), cs, qw, kw, kb.clone(), vb.clone(), loc, ks, vs, hq, hkv, d
        )
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _qk_layer_step(pos, static_qkv, cs, qw, kw, kb, vb, loc, ks, vs, hq, hkv, d)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        new_qkv, new_qw, new_kw = qk_inputs(g, t, hq, hkv, d, d, torch.bfloat16)
        static_qkv.copy_(new_qkv.cuda())
        qw.copy_(new_qw.cuda())
        kw.copy_(new_kw.cuda())
        pos.copy_(torch.randint(0, 256, (t,), generator=g))
        new_loc = torch.randperm(32, generator=g)[:t]
        new_loc[step % t] = -1
        loc.copy_(new_loc)
        ks.fill_(0.25 + step)
        vs.fill_(1.0 / (step + 1))
        e_qkv, e_kb, e_vb = new_qkv.cuda(), kb.clone(), vb.clone()
        _qk_layer_step(pos, e_qkv, cs, qw, kw, e_kb, e_vb, loc, ks, vs, hq, hkv, d)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_writes(static_qkv, kb, vb, e_qkv, e_kb, e_vb)

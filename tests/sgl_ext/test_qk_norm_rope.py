"""apply_qk_norm_rope_with_cos_sin_cache_inplace (q/k RMSNorm + RoPE + KV write) vs a float64
reference: the norm over whole heads, every KV semantic of the RoPE op, validation, compile and
CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg, settings
from tests.sgl_ext.sgl_ext_testutil import (
    FP8,
    LAYOUTS,
    TOL,
    bits,
    make_cos_sin_cache,
    make_kv_buffers,
    quant_ref,
    rope_ref,
    write_slots,
)

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
EPS = 1e-6


def norm_ref(x: torch.Tensor, w: torch.Tensor, head_size: int, eps: float) -> torch.Tensor:
    """Float64 RMSNorm of every head: x [T, H*D] or [T, H, D] -> [T, H, D] f64."""
    xs = x.double().reshape(x.shape[0], -1, head_size)  # [T, H, D]
    rstd = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps)  # [T, H, 1]
    return xs * rstd * w.double()


def _inputs(gen, t, hq, hkv, d, dv, dtype, misalign=False):
    """qkv [T, (Hq + Hkv) * D + Hkv * Dv] with heads of varied scale and offset (the norm has
    something to do), and norm weights ~ N(1, 0.3) in dtype."""
    width = hq * d + hkv * d + hkv * dv
    scale = torch.rand(1, width, generator=gen) * 4 + 0.25
    qkv = torch.randn(t, width, generator=gen) * scale + 0.3
    if misalign:
        qkv = torch.cat((torch.zeros(t, 1), qkv), dim=1)
    qw = (torch.randn(d, generator=gen) * 0.3 + 1.0).to(dtype)
    kw = (torch.randn(d, generator=gen) * 0.3 + 1.0).to(dtype)
    return qkv.to(dtype), qw, kw


def run_case(
    *,
    device="cpu",
    dtype=torch.float32,
    kv_dtype=None,
    layout="token",
    neox=True,
    rot_frac=1.0,
    num_tokens=7,
    hq=4,
    hkv=2,
    d=16,
    dv=None,
    q3d=False,
    scale="none",
    pos_dtype=torch.int64,
    fused=True,
    num_slots=64,
    page_size=4,
    seed=None,
    misalign=False,
):
    """Run the op once on fresh random inputs; check q, k, the cache and V against references."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    kv_dtype = kv_dtype or dtype
    dv = dv or d
    rot = int(d * rot_frac)
    max_pos = 300
    t = num_tokens
    pos = torch.randint(0, max_pos, (t,), generator=gen).to(pos_dtype)
    cs = make_cos_sin_cache(max_pos, rot)
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, dv, dtype, misalign)
    qkv = qkv.to(device)[:, int(misalign) :]  # misalign: rows off a 4-byte boundary
    pos, cs, qw, kw = pos.to(device), cs.to(device), qw.to(device), kw.to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * dv], dim=-1)  # strided views of qkv
    if q3d:
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, dv)
    orig = qkv.clone()
    loc = torch.randperm(num_slots, generator=gen)[:t]
    if t > 2:
        loc[1] = -1
        loc[t // 2] = num_slots + 3  # out of range: not written either
    loc = loc.to(device)
    written = (loc >= 0) & (loc < num_slots)
    if scale == "float":
        ks, vs = 0.37, 1.9
    elif scale == "tensor":
        ks, vs = torch.tensor([0.61], device=device), torch.tensor(2.3, device=device)
    else:
        ks = vs = None
    bases, views = make_kv_buffers(layout, num_slots, hkv, d, dv, kv_dtype, device, page_size)
    expected = tuple(b.clone() for b in bases)
    kb, vb = views(bases)
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc) if fused else None
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, qw, kw, EPS, neox, arg)

    o = orig.cpu()
    p, c = pos.cpu(), cs.cpu()
    q_ref = rope_ref(p, norm_ref(o[:, : hq * d], qw.cpu(), d, EPS), d, c, neox)  # [T, Hq, D]
    k_ref = rope_ref(p, norm_ref(o[:, hq * d : (hq + hkv) * d], kw.cpu(), d, EPS), d, c, neox)
    tol = TOL[dtype]
    torch.testing.assert_close(q.reshape(t, hq, d).cpu().double(), q_ref, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(k.reshape(t, hkv, d).cpu().double(), k_ref, atol=tol * 4, rtol=tol)
    # V (and any column past it) is bit-identical to the input.
    vcols = slice((hq + hkv) * d, None)
    assert torch.equal(bits(qkv.cpu()[:, vcols]), bits(o[:, vcols]))
    if not fused:
        return
    # Written slots hold quantize(the key as returned) and quantize(v), exactly; every other
    # element keeps its poison.
    ek, ev = views(expected)
    sel = written.nonzero().squeeze(1)
    write_slots(ek, loc[sel], quant_ref(k.reshape(t, hkv, d)[sel], kv_dtype, ks))
    write_slots(ev, loc[sel], quant_ref(v.reshape(t, hkv, dv)[sel], kv_dtype, vs))
    for got, exp in zip(bases, expected, strict=True):
        assert torch.equal(bits(got).cpu(), bits(exp).cpu()), "KV cache differs from reference"


# ---------------------------------------------------------------- native backend: the full grid
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
@pytest.mark.parametrize("num_tokens", [1, 7, 33, 257])
def test_native_qk_norm_rope_kv(backend, dtype, neox, rot_frac, num_tokens):
    backend("native")
    run_case(dtype=dtype, neox=neox, rot_frac=rot_frac, num_tokens=num_tokens, num_slots=320)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", [None, *FP8])
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
def test_native_layouts_and_fp8(backend, layout, kv_dtype, scale):
    backend("native")
    run_case(dtype=torch.bfloat16, kv_dtype=kv_dtype, layout=layout, scale=scale, num_tokens=9)


@pytest.mark.parametrize("q3d", [False, True])
@pytest.mark.parametrize("dv", [None, 8])
@pytest.mark.parametrize("fused", [True, False])
def test_native_shapes(backend, q3d, dv, fused):
    backend("native")
    run_case(q3d=q3d, pos_dtype=torch.int32, dv=dv, fused=fused, hq=6)


def _unfused(pos, q, k, v, d, cs, qw, kw, neox, kb, vb, loc, ks, vs):
    """Qwen3's unfused path: HF/Qwen3 RMSNorm in torch (float32 normalise, cast, times weight),
    copied back into the views, then the RoPE op and set_kv_buffer."""
    for x, w in ((q, qw), (k, kw)):
        xs = x.reshape(-1, d)  # [T * H, D] copy of the strided view
        xf = xs.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        x.copy_((w * xf.to(x.dtype)).view(x.shape))
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, neox)
    sgl_ext.set_kv_buffer(k, v, kb, vb, loc, ks, vs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("neox,rot", [(True, 16), (False, 8)])
def test_native_equals_torch_norm_then_rope_op(backend, dtype, neox, rot):
    """The native path is the unfused model path, bit for bit (q, k, caches incl. fp8)."""
    backend("native")
    gen = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 9, 4, 2, 16
    pos = torch.randint(0, 64, (t,), generator=gen)
    cs = make_cos_sin_cache(64, rot)
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, d, dtype)
    loc = torch.randperm(40, generator=gen)[:t]
    loc[2] = -1
    outs = []
    for fused in (True, False):
        x = qkv.clone()
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        kb = torch.zeros(40, hkv, d, dtype=torch.float8_e4m3fn)
        vb = torch.zeros(40, hkv, d, dtype=dtype)
        if fused:
            arg = FusedSetKVBufferArg(v, kb, vb, 0.5, None, loc)
            sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
                pos, q, k, d, cs, qw, kw, EPS, neox, arg
            )
        else:
            _unfused(pos, q, k, v, d, cs, qw, kw, neox, kb, vb, loc, 0.5, None)
        outs.append((bits(x), kb.view(torch.uint8), bits(vb)))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_native_reference_function_matches_op(backend):
    backend("native")
    gen = torch.Generator().manual_seed(4)
    t, hq, hkv, d = 5, 3, 1, 16
    pos = torch.randint(0, 32, (t,), generator=gen)
    cs = make_cos_sin_cache(32, d)
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, d, torch.bfloat16)
    a, b = qkv.clone(), qkv.clone()
    for x, fn in (
        (a, sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace),
        (b, sgl_ext.apply_qk_norm_rope_native),
    ):
        q, k, _ = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        fn(pos, q, k, d, cs, qw, kw, EPS, True)
    assert torch.equal(a, b)


# ---------------------------------------------- Triton kernel (interpreted on CPU): a subset
TRITON_CASES = [
    dict(dtype=torch.float32, neox=True, num_tokens=1),
    dict(dtype=torch.bfloat16, neox=False, rot_frac=0.5),
    dict(dtype=torch.float16, layout="hnd", kv_dtype=torch.float8_e4m3fn, scale="tensor"),
    dict(dtype=torch.bfloat16, layout="cross", kv_dtype=torch.float8_e5m2, scale="float"),
    dict(dtype=torch.float32, layout="flat", q3d=True, pos_dtype=torch.int32, dv=8),
    dict(dtype=torch.bfloat16, layout="nhd", page_size=1, hq=7, hkv=1, rot_frac=0.5),
    dict(dtype=torch.float16, fused=False, rot_frac=0.5, neox=False, d=24),
    dict(dtype=torch.bfloat16, neox=False, misalign=True),
    dict(dtype=torch.bfloat16, neox=True, d=24, rot_frac=0.75, kv_dtype=torch.float8_e4m3fn),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_triton_qk_norm_rope_kv(backend, case):
    backend("triton")
    device = "cuda" if HAS_CUDA else "cpu"
    run_case(device=device, **{"num_tokens": 7, **case})


# Program layouts (heads per program, warps, grid order, merged, spread), as in test_rope.
LAUNCH_CONFIGS = ["1,4,1,0", "2,2,0,1", "4,2,2,1", "2,4,1,1,1"]


@pytest.mark.parametrize("config", LAUNCH_CONFIGS)
@pytest.mark.parametrize(
    "case",
    [
        dict(dtype=torch.bfloat16, hq=6, hkv=2),
        dict(
            dtype=torch.float16,
            hq=3,
            hkv=3,
            rot_frac=0.5,
            kv_dtype=torch.float8_e4m3fn,
            scale="tensor",
            layout="nhd",
            neox=False,
        ),
    ],
    ids=["gqa", "partial-gptj-fp8"],
)
def test_triton_launch_configs(backend, monkeypatch, config, case):
    backend("triton")
    monkeypatch.setenv("SGL_EXT_TRITON_CONFIG", config)
    settings.reload()
    run_case(device="cuda" if HAS_CUDA else "cpu", num_tokens=5, **case)


@pytest.mark.slow
@pytest.mark.parametrize("num_tokens", [33, 257])
def test_triton_default_config(backend, num_tokens):
    """The default launch heuristic past its small-T branches (separate, then merged programs)."""
    backend("triton")
    run_case(
        device="cuda" if HAS_CUDA else "cpu",
        dtype=torch.bfloat16,
        hq=4,
        hkv=2,
        num_tokens=num_tokens,
        num_slots=320,
        layout="nhd",
        page_size=16,
    )


def test_triton_key_equals_cache_and_native_within_rounding(backend):
    """Triton vs native on the same inputs: q/k within a rounding step; the K cache holds
    exactly the key the op returned; V bit-identical."""
    gen = torch.Generator().manual_seed(11)
    t, hq, hkv, d = 6, 4, 2, 16
    dev = "cuda" if HAS_CUDA else "cpu"
    pos = torch.randint(0, 64, (t,), generator=gen).to(dev)
    cs = make_cos_sin_cache(64, d).to(dev)
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, d, torch.bfloat16)
    qkv, qw, kw = qkv.to(dev), qw.to(dev), kw.to(dev)
    loc = torch.tensor([3, -1, 9, 2, 11, 30], device=dev)
    outs = {}
    for name in ("native", "triton"):
        backend(name)
        x = qkv.clone()
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)
        kb = torch.zeros(32, hkv, d, dtype=torch.bfloat16, device=dev)
        vb = torch.zeros_like(kb)
        arg = FusedSetKVBufferArg(v, kb, vb, None, None, loc)
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
            pos, q, k, d, cs, qw, kw, EPS, True, arg
        )
        sel = loc[loc >= 0]
        assert torch.equal(kb[sel], k.view(t, hkv, d)[loc >= 0])
        outs[name] = (q.float(), k.float(), vb)
    torch.testing.assert_close(outs["triton"][0], outs["native"][0], atol=3e-2, rtol=1.6e-2)
    torch.testing.assert_close(outs["triton"][1], outs["native"][1], atol=3e-2, rtol=1.6e-2)
    assert torch.equal(outs["triton"][2], outs["native"][2])


def test_zero_tokens_is_a_no_op(backend):
    for name in ("native", "triton"):
        backend(name)
        dev = "cuda" if (HAS_CUDA and name == "triton") else "cpu"
        q, k, v = (torch.randn(0, n, device=dev) for n in (32, 16, 16))
        kb = torch.randn(8, 1, 16, device=dev)
        before = kb.clone()
        cs = make_cos_sin_cache(10, 16).to(dev)
        w = torch.ones(16, device=dev)
        pos = torch.zeros(0, dtype=torch.long, device=dev)
        loc = torch.zeros(0, dtype=torch.long, device=dev)
        arg = FusedSetKVBufferArg(v, kb, kb.clone(), None, None, loc)
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
            pos, q, k, 16, cs, w, w, EPS, True, arg
        )
        assert torch.equal(kb, before)


# ------------------------------------------------------------------------------- validation
def _valid(dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    t, hq, hkv, d = 3, 2, 1, 16
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, d, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    kb = torch.zeros(8, hkv, d, dtype=dtype)
    arg = FusedSetKVBufferArg(v, kb, kb.clone(), None, None, torch.tensor([0, 1, 2]))
    pos = torch.tensor([0, 1, 2])
    return dict(
        positions=pos,
        query=q,
        key=k,
        head_size=d,
        cos_sin_cache=make_cos_sin_cache(8, d),
        q_norm_weight=qw,
        k_norm_weight=kw,
        eps=EPS,
        is_neox=True,
        fused_set_kv_buffer_arg=arg,
    )


BAD = [
    ("q_norm_weight", lambda a: a["q_norm_weight"].float(), TypeError, "q_norm_weight dtype"),
    ("k_norm_weight", lambda a: a["k_norm_weight"][:8], ValueError, "k_norm_weight must have"),
    ("k_norm_weight", lambda a: a["k_norm_weight"][None], ValueError, "k_norm_weight must have"),
    (
        "q_norm_weight",
        lambda a: torch.ones(32, dtype=torch.bfloat16)[::2],
        ValueError,
        "q_norm_weight must be contiguous",
    ),
    ("q_norm_weight", lambda a: a["q_norm_weight"].tolist(), TypeError, "q_norm_weight must be"),
    (
        "k_norm_weight",
        lambda a: torch.ones(16, dtype=torch.bfloat16, device="meta"),
        ValueError,
        "k_norm_weight is on meta",
    ),
    ("eps", lambda a: 0.0, ValueError, "eps must be"),
    ("eps", lambda a: -1e-6, ValueError, "eps must be"),
    ("eps", lambda a: float("nan"), ValueError, "eps must be"),
    ("eps", lambda a: float("inf"), ValueError, "eps must be"),
    ("eps", lambda a: True, TypeError, "eps must be a float"),
    ("eps", lambda a: "1e-6", TypeError, "eps must be a float"),
    ("eps", lambda a: torch.tensor(1e-6), TypeError, "eps must be a float"),
    ("head_size", lambda a: 8, ValueError, "rotary_dim"),
    ("query", lambda a: a["query"].float(), TypeError, "key dtype"),
]


@pytest.mark.parametrize("name", ["native", "triton"])
@pytest.mark.parametrize(
    "field,make,exc,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_arguments_raise_before_anything_is_written(backend, name, field, make, exc, match):
    backend(name)
    a = _valid()
    a[field] = make(a)
    arg = a["fused_set_kv_buffer_arg"]
    before = [x.clone() for x in (a["query"], a["key"], arg.k_buffer, arg.v_buffer)]
    with pytest.raises(exc, match=match):
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(**a)
    after = (a["query"], a["key"], arg.k_buffer, arg.v_buffer)
    for x, y in zip(before, after, strict=True):
        assert torch.equal(bits(x), bits(y))


def test_bad_kv_argument_leaves_query_and_key_untouched(backend):
    backend("native")
    a = _valid()
    q0, k0 = a["query"].clone(), a["key"].clone()
    arg = a["fused_set_kv_buffer_arg"]
    a["fused_set_kv_buffer_arg"] = FusedSetKVBufferArg(
        arg.value, arg.k_buffer, arg.v_buffer, -1.0, None, arg.cache_loc
    )
    with pytest.raises(ValueError, match="k_scale"):
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(**a)
    assert torch.equal(a["query"], q0) and torch.equal(a["key"], k0)


# --------------------------------------------------------------- torch.compile and CUDA graphs
def _layer_step(pos, qkv, cs, qw, kw, kb, vb, loc, ks, vs, hq, hkv, d):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views of qkv
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc)
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, qw, kw, EPS, True, arg)
    return (q * 2).sum(-1) + k.float().sum(-1)


def _graph_inputs(device, t=6, hq=4, hkv=2, d=16, kv_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 64, (t,), generator=g).to(device)
    qkv, qw, kw = _inputs(g, t, hq, hkv, d, d, torch.bfloat16)
    kb = torch.zeros(4, 8, hkv, d, device=device, dtype=kv_dtype)  # paged [P, ps, H, D]
    loc = torch.randperm(32, generator=g)[:t].to(device)
    loc[0] = -1
    return pos, qkv.to(device), qw.to(device), kw.to(device), kb, torch.zeros_like(kb), loc


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
        pos, qkv, qw, kw, kb, vb, loc = _graph_inputs(device, kv_dtype=kv_dtype, seed=seed)
        e_qkv, e_kb, e_vb = qkv.clone(), kb.clone(), vb.clone()
        out_e = _layer_step(pos, e_qkv, cs, qw, kw, e_kb, e_vb, loc, ks, 2.0, hq, hkv, d)
        out_c = compiled(pos, qkv, cs, qw, kw, kb, vb, loc, ks, 2.0, hq, hkv, d)
        torch.testing.assert_close(out_c, out_e)
        assert torch.equal(qkv, e_qkv)
        assert torch.equal(kb.view(torch.uint8), e_kb.view(torch.uint8))
        assert torch.equal(vb.view(torch.uint8), e_vb.view(torch.uint8))
        assert kb.view(torch.uint8).any()


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_graph_replay_with_new_inputs(backend, kv_dtype):
    """Capture once; between replays change qkv, positions, slots, scales and norm weights."""
    backend("triton")
    hq, hkv, d, t = 8, 2, 128, 5
    cs = make_cos_sin_cache(256, d).cuda()
    pos, qkv, qw, kw, kb, vb, loc = _graph_inputs("cuda", t, hq, hkv, d, kv_dtype)
    ks, vs = torch.tensor([0.5], device="cuda"), torch.tensor([2.0], device="cuda")
    static_qkv = qkv.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (Triton compile) outside the graph
        _layer_step(pos, qkv.clone(), cs, qw, kw, kb.clone(), vb.clone(), loc, ks, vs, hq, hkv, d)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _layer_step(pos, static_qkv, cs, qw, kw, kb, vb, loc, ks, vs, hq, hkv, d)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        new_qkv, new_qw, new_kw = _inputs(g, t, hq, hkv, d, d, torch.bfloat16)
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
        _layer_step(pos, e_qkv, cs, qw, kw, e_kb, e_vb, loc, ks, vs, hq, hkv, d)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_qkv, e_qkv)
        assert torch.equal(kb.view(torch.uint8), e_kb.view(torch.uint8))
        assert torch.equal(vb.view(torch.uint8), e_vb.view(torch.uint8))


@gpu
@pytest.mark.parametrize(
    "kv_dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 7, 257, 1031])
def test_triton_on_cuda_against_float64(backend, kv_dtype, neox, num_tokens):
    """Qwen3-8B head shape (32/8/128) on the GPU, HND paged cache, every grid branch."""
    backend("triton")
    dtype = torch.float16 if kv_dtype == torch.float16 else torch.bfloat16
    run_case(
        device="cuda",
        dtype=dtype,
        kv_dtype=kv_dtype,
        layout="hnd",
        page_size=16,
        neox=neox,
        num_tokens=num_tokens,
        hq=32,
        hkv=8,
        d=128,
        num_slots=2048,
        scale="tensor" if kv_dtype in FP8 else "none",
        seed=num_tokens,
    )


# ------------------------------------------- q/k bits do not depend on the KV write (issue 17)
def _qk_with_and_without_kv(device, t, hq, hkv, d, kv_dtype, seed, calls=2):
    """q/k after the op without the KV write, then with it, on the same inputs; each `calls`
    times (the first call of a plan goes through the JIT, later ones launch directly)."""
    gen = torch.Generator().manual_seed(seed)
    qkv, qw, kw = _inputs(gen, t, hq, hkv, d, d, torch.bfloat16)
    qkv, qw, kw = qkv.to(device), qw.to(device), kw.to(device)
    max_pos = 8192
    pos = torch.randint(0, max_pos, (t,), generator=gen).to(device)
    cs = make_cos_sin_cache(max_pos, d).to(device)
    page, slots = 16, 16 * (t // 16 + 2)
    kb = torch.zeros(slots // page, page, hkv, d, dtype=kv_dtype, device=device)  # [P, ps, H, D]
    loc = torch.randperm(slots, generator=gen)[:t].to(device)
    ks = torch.tensor([0.5], device=device) if kv_dtype in FP8 else None
    out = []
    for fused in (False, True, False, True)[: 2 * calls]:
        x = qkv.clone()
        q, k, v = x.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views
        arg = FusedSetKVBufferArg(v, kb, torch.zeros_like(kb), ks, ks, loc) if fused else None
        sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
            pos, q, k, d, cs, qw, kw, EPS, True, arg
        )
        out.append((fused, bits(q.contiguous()).cpu(), bits(k.contiguous()).cpu()))
    return out


def _assert_same_bits(out):
    _, q0, k0 = out[0]
    for fused, q, k in out[1:]:
        assert torch.equal(q, q0), f"query bits differ (KV write {'on' if fused else 'off'})"
        assert torch.equal(k, k0), f"key bits differ (KV write {'on' if fused else 'off'})"


@pytest.fixture(params=[False, True], ids=["sum_fp32", "sum_fp64"])
def sum_fp64(request, monkeypatch):
    """The norm's sum-of-squares dtype (rope_kv_plan.QK_NORM_SUM_FP64), plans dropped."""
    from sgl_ext.triton import rope_kv_plan

    monkeypatch.setattr(rope_kv_plan, "QK_NORM_SUM_FP64", request.param)
    settings.reload()
    yield request.param
    monkeypatch.undo()
    settings.reload()


@pytest.mark.parametrize("config", ["", "1,4,0,0", "4,2,1,1"], ids=["default", "sep", "merged"])
def test_triton_qk_bits_do_not_depend_on_kv_write(backend, monkeypatch, sum_fp64, config):
    """Interpreter: under each launch layout, with and without the KV write, the op returns the
    same q/k bits (the float32 sum adds in the layout's order: the claim is per layout)."""
    backend("triton")
    dev = "cuda" if HAS_CUDA else "cpu"
    if config:
        monkeypatch.setenv("SGL_EXT_TRITON_CONFIG", config)
        settings.reload()
    out = _qk_with_and_without_kv(dev, 5, 4, 2, 16, torch.bfloat16, seed=3, calls=1)
    _assert_same_bits(out)


def test_triton_fp64_sum_of_squares_against_float64(backend, sum_fp64):
    """Both sum-of-squares dtypes hold the float64 reference (fp8 cache, partial GPT-J too)."""
    backend("triton")
    dev = "cuda" if HAS_CUDA else "cpu"
    run_case(device=dev, dtype=torch.bfloat16, hq=4, hkv=2, num_tokens=7, seed=5)
    run_case(
        device=dev,
        dtype=torch.float16,
        kv_dtype=torch.float8_e4m3fn,
        scale="tensor",
        neox=False,
        rot_frac=0.5,
        hq=3,
        hkv=1,
        num_tokens=6,
        seed=6,
    )


def _plan(t: int, kv_dtype: torch.dtype | None):
    """The Triton launch plan of the op at Qwen3-8B heads (32/8/128, bf16) for T tokens, with a
    KV write into a kv_dtype cache or (None) without one. Metadata only: nothing runs."""
    from sgl_ext import qk_norm_rope
    from sgl_ext._common import QKNormCall
    from sgl_ext.triton.rope_kv_plan import plan_rope_kv

    hq, hkv, d = 32, 8, 128
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views
    pos, loc = torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64)
    cs = torch.empty(16, d)
    w = torch.empty(d, dtype=torch.bfloat16)
    arg = None
    if kv_dtype is not None:
        kb = torch.empty(64, 16, hkv, d, dtype=kv_dtype)  # [pages, page, H, D]
        ks = torch.tensor([0.5]) if kv_dtype != torch.bfloat16 else None
        arg = FusedSetKVBufferArg(v, kb, torch.empty_like(kb), ks, ks, loc)
    call, eps = qk_norm_rope.check(pos, q, k, d, cs, w, w, EPS, True, arg)
    norm = QKNormCall(eps, 0, 0)
    return plan_rope_kv(call, 0, 0, 0, False, norm)


@pytest.mark.parametrize("num_tokens", [1, 8, 9, 64, 513, 897, 4096])
def test_qk_norm_layout_is_the_same_with_and_without_kv_write(num_tokens):
    """The QK_NORM plan's layout (heads per program, warps, blocks, grid) is the same without
    the KV write and with bf16 or fp8 caches (RoPE alone's layout depends on the cache dtype
    past ~900 tokens): the fused and unfused Qwen3 paths sum squares in the same order."""
    keys = ("BLOCK_H", "BLOCK_HKV", "NUM_Q_BLOCKS", "NUM_KV_BLOCKS", "MERGED", "SS_FP64")
    seen = []
    for kv_dtype in (None, torch.bfloat16, torch.float8_e4m3fn):
        plan = _plan(num_tokens, kv_dtype)
        c = plan.constexprs
        assert c["QK_NORM"] and c["WRITE_KV"] == (kv_dtype is not None)
        seen.append(([c[k] for k in keys], plan.options.get("maxnreg"), plan.options["num_warps"]))
    assert seen[1:] == seen[:1] * 2, seen


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 129, 513, 4096])
def test_cuda_qk_bits_do_not_depend_on_kv_write(backend, sum_fp64, kv_dtype, num_tokens):
    """Qwen3-8B shapes (32/8/128, bf16) on the GPU: the op with and without the KV argument
    (the fused and unfused model paths) gives bit-identical q and k, through the JIT and
    through direct launches, with either sum-of-squares dtype (fp8 caches would change RoPE
    alone's layout past ~900 tokens; the QK_NORM plan keeps one)."""
    backend("triton")
    out = _qk_with_and_without_kv("cuda", num_tokens, 32, 8, 128, kv_dtype, seed=num_tokens)
    _assert_same_bits(out)

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

"""apply_rope_with_cos_sin_cache_inplace vs a float64 reference: every semantic of DESIGN §2."""

from __future__ import annotations

import dataclasses
import zlib

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
    loc_dtype=torch.int64,
    fused=True,
    num_slots=64,
    page_size=4,
    seed=None,
    misalign=False,
):
    """Run the op once on fresh random inputs and check everything against the references.

    seed None: a seed derived from the case's arguments (reproducible, different per case)."""
    if seed is None:
        case = dict(locals())  # the arguments only: nothing else is bound yet
        del case["seed"]
        seed = zlib.crc32(repr(sorted(case.items())).encode())
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    dv = dv or d
    rot = int(d * rot_frac)
    max_pos = 300
    t = num_tokens
    pos = torch.randint(0, max_pos, (t,), generator=gen).to(pos_dtype)
    cs = make_cos_sin_cache(max_pos, rot)
    # q, k, v as strided column views of one fused qkv output: [T, (Hq + Hkv) * D + Hkv * Dv].
    qkv = torch.randn(t, hq * d + hkv * d + hkv * dv + misalign, generator=gen).to(dtype)
    # misalign: rows start off a 4-byte boundary (sliced on the device: .to() would copy a
    # non-dense view into a fresh, aligned tensor).
    qkv = qkv.to(device)[:, int(misalign) :]
    pos, cs = pos.to(device), cs.to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * dv], dim=-1)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*Dv]
    if q3d:
        q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, dv)
    orig = qkv.clone()
    # Distinct slots; a few tokens skipped (loc < 0) or out of range (not written either).
    loc = torch.randperm(num_slots, generator=gen)[:t]
    if t > 2:
        loc[1] = -1
        loc[t // 2] = num_slots + 3
    loc = loc.to(loc_dtype).to(device)
    written = (loc >= 0) & (loc < num_slots)
    if scale == "float":
        ks, vs = 0.37, 1.9
    elif scale == "tensor":
        ks = torch.tensor([0.61], device=device)
        vs = torch.tensor(2.3, device=device)
    else:
        ks = vs = None
    bases, views = make_kv_buffers(layout, num_slots, hkv, d, dv, kv_dtype, device, page_size)
    expected = tuple(b.clone() for b in bases)
    kb, vb = views(bases)
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc) if fused else None
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, neox, arg)

    orig_c = orig.cpu()
    q_ref = rope_ref(pos.cpu(), orig_c[:, : hq * d], d, cs.cpu(), neox)  # [T, Hq, D] f64
    k_ref = rope_ref(pos.cpu(), orig_c[:, hq * d : (hq + hkv) * d], d, cs.cpu(), neox)
    tol = TOL[dtype]
    q_out = q.reshape(t, hq, d).cpu().double()
    k_out = k.reshape(t, hkv, d).cpu().double()
    torch.testing.assert_close(q_out, q_ref, atol=tol * 4, rtol=tol)
    torch.testing.assert_close(k_out, k_ref, atol=tol * 4, rtol=tol)
    # Pass-through dims and V are bit-identical to the input.
    qkv_c = qkv.cpu()
    q_tail = torch.cat([torch.arange(h * d + rot, (h + 1) * d) for h in range(hq + hkv)])
    assert torch.equal(bits(qkv_c[:, q_tail]), bits(orig_c[:, q_tail]))
    assert torch.equal(bits(qkv_c[:, (hq + hkv) * d :]), bits(orig_c[:, (hq + hkv) * d :]))
    if not fused:
        return q, k
    # Cache: written slots hold quantize(rotated key as returned) and quantize(v), exactly;
    # every other element keeps its poison.
    ek, ev = views(expected)
    sel = written.nonzero().squeeze(1)
    k_rows = k.reshape(t, hkv, d)[sel]
    v_rows = v.reshape(t, hkv, dv)[sel]
    write_slots(ek, loc[sel], quant_ref(k_rows, kv_dtype, ks))
    write_slots(ev, loc[sel], quant_ref(v_rows, kv_dtype, vs))
    for got, exp in zip(bases, expected, strict=True):
        assert torch.equal(bits(got).cpu(), bits(exp).cpu()), "KV cache differs from reference"
    return q, k


# ---------------------------------------------------------------- native backend: the full grid
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rot_frac", [1.0, 0.5])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_native_rope_kv(backend, dtype, neox, rot_frac, num_tokens):
    backend("native")
    run_case(dtype=dtype, neox=neox, rot_frac=rot_frac, num_tokens=num_tokens)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kv_dtype", [None, *FP8])
@pytest.mark.parametrize("scale", ["none", "float", "tensor"])
def test_native_layouts_and_fp8(backend, layout, kv_dtype, scale):
    backend("native")
    run_case(dtype=torch.bfloat16, kv_dtype=kv_dtype, layout=layout, scale=scale, num_tokens=9)


@pytest.mark.parametrize("q3d", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dv", [None, 8])
@pytest.mark.parametrize("fused", [True, False])
def test_native_shapes_and_index_dtypes(backend, q3d, index_dtype, dv, fused):
    backend("native")
    run_case(q3d=q3d, pos_dtype=index_dtype, loc_dtype=index_dtype, dv=dv, fused=fused, hq=6)


def test_native_page_size_one_and_odd_heads(backend):
    backend("native")
    run_case(layout="nhd", page_size=1, hq=7, hkv=1, num_tokens=33, dtype=torch.float16)
    run_case(layout="hnd", page_size=16, num_slots=64, hq=3, hkv=3, num_tokens=5)


# ---------------------------------------------- Triton kernel (interpreted on CPU): a subset
TRITON_CASES = [
    dict(dtype=torch.float32, neox=True),
    dict(dtype=torch.bfloat16, neox=False, rot_frac=0.5),
    dict(dtype=torch.float16, layout="hnd", kv_dtype=torch.float8_e4m3fn, scale="tensor"),
    dict(dtype=torch.bfloat16, layout="cross", kv_dtype=torch.float8_e5m2, scale="float"),
    dict(dtype=torch.float32, layout="flat", q3d=True, pos_dtype=torch.int32, dv=8),
    dict(dtype=torch.bfloat16, layout="nhd", page_size=1, hq=7, hkv=1, num_tokens=1),
    dict(dtype=torch.float16, fused=False, rot_frac=0.5, neox=False, d=24),
    dict(dtype=torch.float32, neox=False, layout="nhd", page_size=16),
    dict(dtype=torch.bfloat16, neox=False, misalign=True),
    dict(dtype=torch.bfloat16, neox=False, kv_dtype=torch.float8_e5m2, layout="hnd"),
    dict(dtype=torch.float16, neox=False, layout="cross", num_tokens=33, hq=3, hkv=3),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_triton_rope_kv(backend, case):
    backend("triton")
    device = "cuda" if HAS_CUDA else "cpu"
    run_case(device=device, num_tokens=case.pop("num_tokens", 5), **case)


# "heads per program, warps, grid order, merged, spread[, maxnreg, pos_last, hoist,
# early_release, load_barrier, kv_block_h]": every program layout the launcher can pick (order
# 0: 2-D grid, 1: token-major, 2: key/value programs first; hoist: merged programs issue every
# load before the key/value branch; load_barrier: every load, a barrier, then cos/sin).
LAUNCH_CONFIGS = [
    "1,4,1,0",
    "2,2,0,0",
    "2,1,1,1",
    "4,2,1,1",
    "8,4,0,1",
    "2,4,1,1,1",
    "1,2,2,1",
    "2,4,2,1",
    "8,4,2,1",
    "2,1,1,1,0,0,0,1",
    "4,2,1,1,1,0,0,1",
    "2,4,2,1,0,0,1,1,1",
    "2,2,0,0,0,0,0,0,0,1",
    "4,2,1,1,0,0,0,0,0,1",
    "2,4,2,1,0,0,0,1,0,1",
    "4,4,1,0,0,0,0,0,0,1,1",
    # PRE_WAIT (position and cos/sin before the PDL wait), with the slot and its cache rows
    # before it too (SLOT_PRE): separate programs, merged with HOIST
    "2,2,0,0,0,0,0,0,0,0,0,1",
    "2,2,0,0,0,0,0,0,0,0,0,1,0,1",
    "2,2,1,1,0,0,0,1,0,0,0,1,0,1",
    "4,4,0,0,0,0,0,0,0,0,0,1",  # the H200's decode layouts (DECODE_DEVICE_LAYOUTS): T <= 8
    "16,4,0,0,0,0,0,0,1,0,0,1",  # ... and 25..64
]


@pytest.mark.parametrize("config", LAUNCH_CONFIGS)
@pytest.mark.parametrize(
    "case",
    [
        dict(dtype=torch.bfloat16, hq=6, hkv=2, num_tokens=7),
        dict(
            dtype=torch.float16,
            hq=3,
            hkv=3,
            rot_frac=0.5,
            kv_dtype=torch.float8_e4m3fn,
            scale="tensor",
            layout="nhd",
        ),
        dict(dtype=torch.float32, hq=5, hkv=1, neox=False, fused=False, num_tokens=4),
        dict(
            dtype=torch.bfloat16,
            hq=4,
            hkv=2,
            neox=False,
            kv_dtype=torch.float8_e5m2,
            scale="float",
            layout="hnd",
            num_tokens=6,
        ),
    ],
    ids=["gqa", "partial-fp8", "rope-only", "gptj-words-fp8"],
)
def test_triton_launch_configs(backend, monkeypatch, config, case):
    backend("triton")
    monkeypatch.setenv("SGL_EXT_TRITON_CONFIG", config)
    settings.reload()
    run_case(device="cuda" if HAS_CUDA else "cpu", **case)


@pytest.mark.parametrize("num_tokens", [65, 257])
def test_triton_default_config_odd_head_dim(backend, num_tokens):
    """The default launch heuristic at batch sizes past its small-T branch, with a head size
    that is not a power of two (heads per program must still be one)."""
    backend("triton")
    run_case(
        device="cuda" if HAS_CUDA else "cpu",
        dtype=torch.bfloat16,
        d=24,
        hq=6,
        hkv=2,
        num_tokens=num_tokens,
        num_slots=320,
        layout="nhd",
        page_size=16,
    )


@pytest.mark.slow  # interpreter-heavy on CPU (~40 s); still runs in CI
@pytest.mark.parametrize(
    "kv_dtype,scale,num_tokens", [(torch.bfloat16, None, 449), (torch.float8_e4m3fn, "tensor", 401)]
)
def test_triton_default_config_key_value_first(backend, kv_dtype, scale, num_tokens):
    """The default heuristic's key/value-first grid order (D = 128, a few hundred tokens): every
    token's key/value program runs before the query-only ones and each program still finds
    its token and head block."""
    from sgl_ext.launch_layout import GridOrder
    from sgl_ext.triton.rope_kv_plan import launch_config

    cfg = launch_config(num_tokens, 16, 128, kv_dtype != torch.bfloat16)
    assert cfg.order is GridOrder.KV_FIRST
    backend("triton")
    run_case(
        device="cuda" if HAS_CUDA else "cpu",
        dtype=torch.bfloat16,
        d=128,
        hq=16,
        hkv=2,
        num_tokens=num_tokens,
        num_slots=1024,
        kv_dtype=kv_dtype,
        scale=scale,
    )


@pytest.mark.slow  # interpreter-heavy on CPU (~105 s); still runs in CI
@pytest.mark.parametrize("d,hq,hkv", [(128, 16, 2), (64, 16, 2)])
def test_triton_default_config_fp8_large_batch(backend, d, hq, hkv):
    """The default heuristic's fp8 block shape past ~1K tokens (16 heads per program; at D = 64
    with a register cap, which only the GPU compile applies)."""
    from sgl_ext.triton.rope_kv_plan import launch_config

    cfg = launch_config(897, hq, d, fp8_cache=True)
    assert (cfg.block_h, cfg.num_warps, cfg.maxnreg) == (16, 4, 40 if d == 64 else 0)
    backend("triton")
    run_case(
        device="cuda" if HAS_CUDA else "cpu",
        dtype=torch.bfloat16,
        d=d,
        hq=hq,
        hkv=hkv,
        num_tokens=897,
        num_slots=1024,
        kv_dtype=torch.float8_e4m3fn,
        scale="tensor",
    )


def test_launch_config_heads_per_program_is_a_power_of_two():
    """tl.arange needs a power of two; the interpreter would not notice, the GPU compile would."""
    from sgl_ext.triton.rope_kv_plan import launch_config

    for d in (24, 64, 80, 96, 128, 256):
        for t in (1, 9, 65, 257, 5000):
            for heads in (1, 3, 32, 64):
                cfg = launch_config(t, heads, d)
                bh, nw = cfg.block_h, cfg.num_warps
                assert bh & (bh - 1) == 0 and 1 <= bh <= 32, (d, t, heads, bh)
                assert nw in (1, 2, 4, 8)


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_decode_device_layouts_by_gpu_name(monkeypatch, name):
    """A GPU whose name holds a DECODE_DEVICE_LAYOUTS key (rope_kv.json's devices) takes the
    layout of its row for (T, D, cache) (heads capped at the call's); any other GPU, T, D and
    caches outside its rows and no device take the H100's."""
    from sgl_ext import device_tables
    from sgl_ext.triton import rope_kv_plan as rp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(device_tables, "_names", {})
    cuda = torch.device("cuda", 0)
    rows = next((r for sub, r in rp.DECODE_DEVICE_LAYOUTS.items() if sub in name), ())
    assert all(r.last is not None and 1 <= r.first <= r.last <= 64 for r in rows)
    assert all(r.cache == "16bit" for r in rows)  # the device is passed for 16-bit caches
    for t in (1, 2, 8, 9, 24, 25, 33, 64, 65):
        for heads in (1, 2, 32, 64):
            for fp8 in (False, True):
                for d in (64, 80, 128):
                    base = rp.launch_config(t, heads, d, fp8)
                    cfg = rp.launch_config(t, heads, d, fp8, cuda)
                    cache = "fp8" if fp8 else "16bit"
                    own = [r for r in rows if r.covers(t) and (r.head_dim, r.cache) == (d, cache)]
                    if own:
                        c = own[0].config
                        assert cfg == dataclasses.replace(c, block_h=min(c.block_h, heads))
                    else:
                        assert cfg == base
    assert rp.launch_config(1, 32, 128).block_h == 1  # no device: the H100's one head
    if "H200" in name:  # the rows this test is about
        assert rp.launch_config(8, 32, 128, False, cuda).block_h == 4
        assert rp.launch_config(40, 64, 64, False, cuda).block_h == 16


@pytest.mark.parametrize(
    "d,t,want",
    [(128, 1, 4), (128, 8, 4), (128, 9, 4), (128, 17, 4), (128, 64, 4), (128, 65, 0)]
    + [(64, 1, 4), (64, 9, 4), (64, 64, 4)]
    + [(64, 65, 3), (64, 300, 3), (64, 1024, 3), (64, 1025, 0)],
)
def test_plan_load_barrier_follows_launch_config(d, t, want):
    """The RoPE op's plan loads every input before one barrier (the kernel's POS_LAST 3) at
    the token counts launch_config gives LOAD_BARRIER for a bf16 cache (gpt-oss heads from 65
    tokens), and never for an fp8 cache, whose layouts were not measured with it; up to 64
    tokens, with either cache, the position and its cos/sin row before the PDL wait (POS_LAST
    4)."""
    from sgl_ext import rope
    from sgl_ext.triton.rope_kv_plan import plan_rope_kv

    hq, hkv = (32, 8) if d == 128 else (64, 8)
    for kv_dtype, expect in ((torch.bfloat16, want), (torch.float8_e4m3fn, 4 if t <= 64 else 0)):
        qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views
        kb = torch.empty(64, 16, hkv, d, dtype=kv_dtype)  # [pages, page, H, D]
        ks = torch.tensor([0.5]) if kv_dtype != torch.bfloat16 else None
        loc = torch.zeros(t, dtype=torch.int64)
        arg = FusedSetKVBufferArg(v, kb, torch.empty_like(kb), ks, ks, loc)
        call = rope.check(loc, q, k, d, torch.empty(16, d), True, arg)
        assert plan_rope_kv(call, 0, 0, 0, False).constexprs["POS_LAST"] == expect


def test_float_scale_inverted_on_host_like_the_reference():
    """A python-float scale reaches the kernel as its fp32 reciprocal: bit-equal to what the
    native reference computes (fp32(scale), then one fp32 division)."""
    from sgl_ext._common import scale_args  # the Triton launcher's

    gen = torch.Generator().manual_seed(1)
    scales = (torch.rand(2000, generator=gen, dtype=torch.float64) * 8 - 4).exp2().tolist()
    scales += [0.37, 1.9, 1e-30, 3e37, 448.0, 1.0 / 3]
    for s in scales:
        mode, _, inv = scale_args(s)
        want = torch.reciprocal(torch.tensor(s, dtype=torch.float32)).item()
        assert mode == 1 and inv == want, (s, inv, want)


def test_fused_equals_rope_plus_set_kv_buffer(backend):
    """The fused op and RoPE alone + set_kv_buffer give the same bits, in each backend."""
    for name in ("native", "triton"):
        backend(name)
        device = "cuda" if (HAS_CUDA and name == "triton") else "cpu"
        gen = torch.Generator().manual_seed(7)
        t, hq, hkv, d = 5, 4, 2, 16
        pos = torch.randint(0, 50, (t,), generator=gen).to(device)
        cs = make_cos_sin_cache(50, d).to(device)
        q = torch.randn(t, hq * d, generator=gen).bfloat16().to(device)
        k = torch.randn(t, hkv * d, generator=gen).bfloat16().to(device)
        v = torch.randn(t, hkv * d, generator=gen).bfloat16().to(device)
        loc = torch.tensor([5, -1, 9, 2, 11], device=device)
        outs = []
        for fused in (True, False):
            qq, kk = q.clone(), k.clone()
            kb = torch.zeros(16, hkv, d, dtype=torch.float8_e4m3fn, device=device)
            vb = torch.zeros_like(kb)
            arg = FusedSetKVBufferArg(v, kb, vb, 0.5, 0.25, loc) if fused else None
            sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, qq, kk, d, cs, True, arg)
            if not fused:
                sgl_ext.set_kv_buffer(kk, v, kb, vb, loc, 0.5, 0.25)
            outs.append((qq, kk, kb.view(torch.uint8), vb.view(torch.uint8)))
        for a, b in zip(*outs, strict=True):
            assert torch.equal(a, b)


def test_zero_tokens_is_a_no_op(backend):
    for name in ("native", "triton"):
        backend(name)
        dev = "cuda" if (HAS_CUDA and name == "triton") else "cpu"
        q, k, v = (torch.randn(0, n, device=dev) for n in (32, 16, 16))
        kb = torch.randn(8, 1, 16, device=dev)
        before = kb.clone()
        cs = make_cos_sin_cache(10, 16).to(dev)
        pos = torch.zeros(0, dtype=torch.long, device=dev)
        loc = torch.zeros(0, dtype=torch.long, device=dev)
        arg = FusedSetKVBufferArg(v, kb, kb.clone(), None, None, loc)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 16, cs, True, arg)
        assert torch.equal(kb, before)


def test_native_write_is_sync_free():
    """The native KV write never reads a device value on the host (CUDA-graph capturable)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
        kb, vb = torch.zeros(16, 2, 16), torch.zeros(16, 2, 16)
        loc = torch.tensor([3, -1, 5, 7, 40])
        sgl_ext.set_kv_buffer_native(k, v, kb, vb, loc)
        kb8 = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
        sgl_ext.set_kv_buffer_native(k, v, kb8, kb8.clone(), loc, 0.5, 2.0)

"""sgl_ext.qkv_proj_with_rope_kv: the qkv GEMM with RoPE and the KV write in its epilogue.

CPU (Triton interpreted): the fused kernel against float64 (odd sizes, neox and GPT-J, bias,
paged and fp8 caches with scales, skipped slots), the fallbacks, the checks. GPU (skipped
without CUDA): bit for bit the two ops it replaces (skinny GEMM + RoPE op) at gpt-oss-20b and
Llama-3-8B shapes, and a CUDA graph replay equal to the eager call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from sgl_ext.gemm import GemmConfig, linear_small_m
from tests.sgl_ext.sgl_ext_testutil import (
    TOL,
    bits,
    make_cos_sin_cache,
    poison,
    quant_ref,
    rope_ref,
    run_compile_script,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FMA = GemmConfig(block_n=4, block_k=32, num_warps=1, num_stages=2)


def _problem(m, hq, hkv, d, k, dtype, bias, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed * 1000 + m * 7 + hq * 31 + d + k)
    n = (hq + 2 * hkv) * d
    x = torch.randn(m, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    pos = torch.randint(0, 300, (m,), generator=g).to(device)
    return x, w, b, pos


def _cache(hkv, d, dtype, page_size, slots=24, device=DEV):
    shape = (slots // page_size, page_size, hkv, d)
    return poison(torch.empty(shape, dtype=dtype, device=device)), poison(
        torch.empty(shape, dtype=dtype, device=device)
    )


def _call(x, w, b, pos, cs, d, hkv, neox, kv, loc, cfg, scales=(None, None)):
    """out (poisoned, then written) and the fused argument (None without kv)."""
    out = poison(torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device))
    arg = None
    if kv is not None:
        v = out[:, out.shape[1] - hkv * d :]  # out's v columns
        arg = FusedSetKVBufferArg(v, kv[0], kv[1], scales[0], scales[1], loc)
    sgl_ext.qkv_proj_with_rope_kv(x, w, b, pos, cs, d, hkv, out, neox, arg, cfg)
    return out


def _slot(buf, s):
    return buf.view(-1, *buf.shape[2:])[s]  # [H, D] of slot s


@pytest.mark.parametrize(
    "dtype, m, hq, hkv, d, k, neox, bias, page",
    [
        (torch.bfloat16, 1, 4, 2, 16, 96, True, True, 1),
        (torch.bfloat16, 3, 3, 1, 8, 40, False, False, 4),  # K not a multiple of BLOCK_K
        (torch.float16, 7, 2, 2, 32, 64, True, True, 2),
        (torch.float32, 2, 4, 1, 16, 33, False, True, 1),
    ],
)
def test_fused_kernel_matches_float64(backend, dtype, m, hq, hkv, d, k, neox, bias, page):
    backend("triton")
    x, w, b, pos = _problem(m, hq, hkv, d, k, dtype, bias)
    cs = make_cos_sin_cache(320, d).to(DEV)
    kbuf, vbuf = _cache(hkv, d, dtype, page)
    loc = torch.randperm(24)[:m].to(DEV)
    loc[0] = -1  # skipped: nothing written for token 0
    out = _call(x, w, b, pos, cs, d, hkv, neox, (kbuf, vbuf), loc, FMA)
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)  # [M, N]
    qs, ks = hq * d, hkv * d
    ref_q = rope_ref(pos, ref[:, :qs], d, cs, neox).reshape(m, -1)
    ref_k = rope_ref(pos, ref[:, qs : qs + ks], d, cs, neox).reshape(m, -1)
    tol = TOL[dtype]
    torch.testing.assert_close(out[:, :qs].double(), ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(out[:, qs : qs + ks].double(), ref_k, atol=tol, rtol=tol)
    torch.testing.assert_close(out[:, qs + ks :].double(), ref[:, qs + ks :], atol=tol, rtol=tol)
    for t in range(m):  # the cache holds exactly the returned k and v
        s = int(loc[t])
        if s < 0:
            continue
        assert torch.equal(bits(_slot(kbuf, s)), bits(out[t, qs : qs + ks].view(hkv, d)))
        assert torch.equal(bits(_slot(vbuf, s)), bits(out[t, qs + ks :].view(hkv, d)))
    written = {int(s) for s in loc if s >= 0}
    for s in set(range(24)) - written:  # every other slot still poisoned
        assert bool(_slot(kbuf, s).isnan().all()) and bool(_slot(vbuf, s).isnan().all())


@pytest.mark.parametrize("scale", [None, 0.5, "tensor"])
def test_fused_kernel_fp8_cache(backend, scale):
    backend("triton")
    m, hq, hkv, d, k = 3, 2, 2, 16, 64
    x, w, b, pos = _problem(m, hq, hkv, d, k, torch.bfloat16, True, seed=2)
    x = x * 8  # values past e4m3's range saturate
    cs = make_cos_sin_cache(320, d).to(DEV)
    kbuf, vbuf = _cache(hkv, d, torch.float8_e4m3fn, 2)
    s = torch.tensor([0.25], device=DEV) if scale == "tensor" else scale
    loc = torch.tensor([5, 0, 11], device=DEV)
    out = _call(x, w, b, pos, cs, d, hkv, True, (kbuf, vbuf), loc, FMA, (s, s))
    qs, ks = hq * d, hkv * d
    for t in range(m):
        kq = quant_ref(out[t, qs : qs + ks].view(hkv, d), torch.float8_e4m3fn, s)
        vq = quant_ref(out[t, qs + ks :].view(hkv, d), torch.float8_e4m3fn, s)
        assert torch.equal(bits(_slot(kbuf, int(loc[t]))), bits(kq))
        assert torch.equal(bits(_slot(vbuf, int(loc[t]))), bits(vq))


@pytest.mark.parametrize(
    "cfg",
    [None, GemmConfig(block_n=16, block_k=32, dot=True), GemmConfig(block_n=32, block_k=32)],
    ids=["f_linear", "dot", "block_n_over_head"],
)
def test_other_calls_run_the_two_ops(backend, cfg):
    """No fused kernel for these (F.linear, a tensor-core config, BLOCK_N past the head): the
    skinny GEMM / F.linear, then the RoPE op, with the same results."""
    backend("triton")
    m, hq, hkv, d, k = 2, 2, 1, 16, 64
    x, w, b, pos = _problem(m, hq, hkv, d, k, torch.float32, True, seed=3)
    cs = make_cos_sin_cache(320, d).to(DEV)
    kbuf, vbuf = _cache(hkv, d, torch.float32, 1)
    loc = torch.tensor([3, 7], device=DEV)
    out = _call(x, w, b, pos, cs, d, hkv, True, (kbuf, vbuf), loc, cfg)
    ref = F.linear(x, w, b) if cfg is None else linear_small_m(x, w, b, cfg)
    want = ref.clone()
    qs, ks = hq * d, hkv * d
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, want[:, :qs], want[:, qs : qs + ks], d, cs)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(bits(_slot(kbuf, 7)), bits(out[1, qs : qs + ks].view(hkv, d)))


def test_native_reference(backend):
    """The torch-native reference: float64 within tolerance, the cache holding its k and v."""
    backend("native")
    m, hq, hkv, d, k = 3, 2, 1, 8, 24
    x, w, b, pos = _problem(m, hq, hkv, d, k, torch.float32, True, seed=4)
    cs = make_cos_sin_cache(320, d).to(DEV)
    out = poison(torch.empty(m, w.shape[0], device=DEV))
    kbuf, vbuf = _cache(hkv, d, torch.float32, 1)
    loc = torch.tensor([1, -1, 2], device=DEV)
    arg = FusedSetKVBufferArg(out[:, -hkv * d :], kbuf, vbuf, None, None, loc)
    sgl_ext.qkv_proj_with_rope_kv_native(x, w, b, pos, cs, d, hkv, out, True, arg)
    ref = x.double() @ w.double().t() + b.double()
    want_q = rope_ref(pos, ref[:, : hq * d], d, cs, True).reshape(m, -1)
    torch.testing.assert_close(out[:, : hq * d].double(), want_q, atol=1e-5, rtol=1e-5)
    assert torch.equal(_slot(vbuf, 2), out[2, -hkv * d :].view(hkv, d))
    assert torch.equal(_slot(kbuf, 1), out[0, hq * d : (hq + hkv) * d].view(hkv, d))
    assert bool(_slot(kbuf, 0).isnan().all())


def test_bad_input_raises_before_writing(backend):
    backend("triton")
    m, hq, hkv, d, k = 2, 2, 1, 16, 32
    x, w, b, pos = _problem(m, hq, hkv, d, k, torch.bfloat16, True, seed=5)
    cs = make_cos_sin_cache(320, d).to(DEV)
    kbuf, vbuf = _cache(hkv, d, torch.bfloat16, 1)
    loc = torch.tensor([0, 1], device=DEV)
    out = poison(torch.empty(m, w.shape[0], dtype=torch.bfloat16, device=DEV))
    other = torch.empty(m, hkv * d, dtype=torch.bfloat16, device=DEV)
    cases = [
        (dict(num_kv_heads=3), "rows"),
        (dict(out=out[:, 1:]), "out must be"),
        (dict(arg=FusedSetKVBufferArg(other, kbuf, vbuf, None, None, loc)), "v columns"),
        (dict(positions=pos[:1]), "tokens"),
        (dict(config="fma"), "config"),
    ]
    for kw, match in cases:
        args = dict(num_kv_heads=hkv, out=out, config=FMA)
        args.update(kw)
        a = args.pop("arg", None)
        if a is None:
            a = FusedSetKVBufferArg(args["out"][:, -hkv * d :], kbuf, vbuf, None, None, loc)
        p = args.pop("positions", pos)
        with pytest.raises((ValueError, TypeError), match=match):
            sgl_ext.qkv_proj_with_rope_kv(
                x, w, b, p, cs, d, args["num_kv_heads"], args["out"], True, a, args["config"]
            )
    assert bool(out.isnan().all()) and bool(kbuf.isnan().all()) and bool(vbuf.isnan().all())


SHAPES = {  # (Hq, Hkv, D, K, bias): gpt-oss-20b, Llama-3-8B
    "gpt-oss-20b": (64, 8, 64, 2880, True),
    "llama3-8b": (32, 8, 128, 4096, False),
}
GPU_CONFIGS = [
    GemmConfig(4, 1024, 2, 3),  # gpt-oss qkv M = 1 (gemm_choice)
    GemmConfig(2, 2048, 4, 1),
    GemmConfig(16, 256, 4, 3),
]


def _two_ops(x, w, b, pos, cs, d, hkv, neox, kv, loc, cfg):
    out = linear_small_m(x, w, b, cfg)
    qs, ks = out.shape[1] - 2 * hkv * d, hkv * d
    arg = FusedSetKVBufferArg(out[:, qs + ks :], kv[0], kv[1], None, None, loc)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(
        pos, out[:, :qs], out[:, qs : qs + ks], d, cs, neox, arg
    )
    return out


@gpu
@pytest.mark.parametrize("model", sorted(SHAPES))
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: c.tag)
@pytest.mark.parametrize("neox", [True, False])
def test_cuda_equals_two_ops_bit_for_bit(model, m, cfg, neox):
    hq, hkv, d, k, bias = SHAPES[model]
    x, w, b, pos = _problem(m, hq, hkv, d, k, torch.bfloat16, bias, seed=6, device="cuda")
    cs = make_cos_sin_cache(4096, d).cuda()
    pos = pos * 13  # positions across the table
    loc = torch.randperm(24)[:m].cuda()
    loc[-1] = -1
    kv1, kv2 = (
        _cache(hkv, d, torch.bfloat16, 4, device="cuda"),
        _cache(hkv, d, torch.bfloat16, 4, device="cuda"),
    )
    out = _call(x, w, b, pos, cs, d, hkv, neox, kv1, loc, cfg)
    want = _two_ops(x, w, b, pos, cs, d, hkv, neox, kv2, loc, cfg)
    assert torch.equal(bits(out), bits(want))
    assert torch.equal(bits(kv1[0]), bits(kv2[0])) and torch.equal(bits(kv1[1]), bits(kv2[1]))


@gpu
def test_cuda_graph_equals_eager():
    hq, hkv, d, k, bias = SHAPES["gpt-oss-20b"]
    m, cfg = 2, GPU_CONFIGS[0]
    x, w, b, pos = _problem(m, hq, hkv, d, k, torch.bfloat16, bias, seed=7, device="cuda")
    cs = make_cos_sin_cache(4096, d).cuda()
    loc = torch.tensor([3, 9], device="cuda")
    kv = _cache(hkv, d, torch.bfloat16, 1, device="cuda")
    out = torch.empty(m, w.shape[0], dtype=torch.bfloat16, device="cuda")
    arg = FusedSetKVBufferArg(out[:, -hkv * d :], kv[0], kv[1], None, None, loc)

    def step():
        sgl_ext.qkv_proj_with_rope_kv(x, w, b, pos, cs, d, hkv, out, True, arg, cfg)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: the plan and the compile
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    x.copy_(torch.randn_like(x))
    pos.copy_(torch.tensor([100, 2000], device="cuda"))
    poison(out)
    poison(kv[0])
    g.replay()
    torch.cuda.synchronize()
    got, got_k = out.clone(), kv[0].clone()
    poison(out)
    poison(kv[0])
    step()
    assert torch.equal(bits(got), bits(out)) and torch.equal(bits(got_k), bits(kv[0]))


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sgl_ext.triton.gemm_rope_kv import gemm_rope_kv_kernel as K

ptrs = dict(X="*bf16", W="*bf16", Bias="*bf16", Out="*bf16", Pos="*i64", CosSin="*fp32",
            KBuf="*bf16", VBuf="*bf16", Loc="*i64", KScale="*fp32", VScale="*fp32")
ints = ("M", "K", "stride_xm", "stride_wn", "stride_om", "cs_stride", "max_pos",
        "kb_page_stride", "kb_off_stride", "kb_head_stride", "vb_page_stride", "vb_off_stride",
        "vb_head_stride", "num_slots")
sig = dict(ptrs, **{n: "i32" for n in ints}, k_scale_f="fp32", v_scale_f="fp32")
for bm, bn, bk, neox, even, fp8 in [(1, 4, 1024, True, False, False), (8, 16, 256, False, True,
        True)]:
    if fp8:
        sig.update(KBuf="*fp8e4nv", VBuf="*fp8e5")
    consts = dict(NUM_Q_HEADS=8, NUM_KV_HEADS=2, HEAD_DIM=64, IS_NEOX=neox, BLOCK_M=bm,
                  BLOCK_N=bn, BLOCK_K=bk, HAS_BIAS=not even, EVEN_K=even, WRITE_KV=True,
                  PAGE_SIZE=4, K_SCALE_MODE=2 if fp8 else 0, V_SCALE_MODE=1 if fp8 else 0,
                  K_FP8_MAX=448.0 if fp8 else 0, V_FP8_MAX=57344.0 if fp8 else 0, EMULATE=False,
                  USE_PDL=True)
    s = dict(sig, **{k: "constexpr" for k in consts})
    triton.compile(ASTSource(K, s, consts, {}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 2, "num_stages": 3})
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """A real sm_90 compile (the interpreter misses front-end errors): bf16 and fp8 caches."""
    run_compile_script(_COMPILE)

"""The CUDA C++ kernel (sgl_ext/csrc/rope_kv.cu): build on CPU where nvcc exists, and on the GPU
the same float64-reference checks as the other backends, plus its dispatch rules."""

from __future__ import annotations

import ctypes

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg, settings
from sgl_ext.cuda import jit
from tests.sgl_ext.test_rope import run_case

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
needs_nvcc = pytest.mark.skipif(jit.find_nvcc() is None, reason="needs nvcc")


# ---------------------------------------------------------------- CPU: build and launch shapes
@needs_nvcc
def test_builds_for_hopper_and_struct_matches(tmp_path):
    """nvcc builds the kernel library for sm_90 without a GPU; the ctypes mirror of the parameter
    struct has the C size; a second build is a cache hit."""
    from sgl_ext.cuda.rope_kv import _Params

    lib_path = jit.build("rope_kv", (9, 0), out_dir=tmp_path)
    assert jit.build("rope_kv", (9, 0), out_dir=tmp_path) == lib_path
    lib = ctypes.CDLL(str(lib_path))
    assert lib.sgl_ext_rope_kv_struct_size() == ctypes.sizeof(_Params)
    assert [p.name for p in tmp_path.iterdir()] == [lib_path.name]  # no temporary files left


def test_build_without_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(jit, "find_nvcc", lambda: None)
    with pytest.raises(jit.BuildError, match="nvcc not found"):
        jit.build("rope_kv", (9, 0), out_dir=tmp_path)


@pytest.mark.parametrize("num_tokens", [1, 7, 65, 4096])
@pytest.mark.parametrize("shape", [(40, 128, 8), (72, 64, 4), (2, 16, 3), (136, 200, 1)])
def test_launch_config_covers_every_lane(num_tokens, shape):
    """(heads, copy pieces, rotary chunks): blocks of whole warps, at most 512 threads, and the
    lane blocks cover every lane without an empty block."""
    from sgl_ext.cuda.rope_kv import launch_config, num_lanes

    bx, tpb, heads = launch_config(num_tokens, *shape)
    assert bx % 32 == 0 and 32 <= bx <= 128 and tpb == 1 and heads in (1, 4)
    lanes = num_lanes(*shape, heads)
    chunks = -(-lanes // bx)
    assert chunks * bx >= lanes and (chunks - 1) * bx < lanes


# ---------------------------------------------------------------- GPU: against the reference
CUDA_CASES = [
    dict(dtype=torch.bfloat16, num_tokens=1),
    dict(dtype=torch.float16, num_tokens=7, neox=False),
    dict(
        dtype=torch.bfloat16,
        num_tokens=33,
        d=32,
        rot_frac=0.5,
        layout="nhd",
        page_size=3,
        num_slots=63,
    ),
    dict(
        dtype=torch.bfloat16,
        num_tokens=257,
        d=64,
        hq=8,
        hkv=2,
        layout="hnd",
        page_size=16,
        num_slots=320,
    ),
    dict(dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, scale="tensor", layout="cross"),
    dict(
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e4m3fn,
        scale="float",
        neox=False,
        d=32,
        rot_frac=0.5,
    ),
    dict(
        dtype=torch.bfloat16,
        kv_dtype=torch.float8_e5m2,
        scale="tensor",
        layout="flat",
        pos_dtype=torch.int32,
        loc_dtype=torch.int32,
    ),
    dict(dtype=torch.bfloat16, kv_dtype=torch.bfloat16, scale="float", q3d=True, dv=8),
    dict(dtype=torch.float16, fused=False, neox=False, d=48, num_tokens=9),
    dict(dtype=torch.bfloat16, hq=7, hkv=1, num_tokens=1, layout="nhd", page_size=1),
    dict(
        dtype=torch.bfloat16,
        hq=3,
        hkv=3,
        d=128,
        num_tokens=33,
        kv_dtype=torch.float8_e4m3fn,
        scale="tensor",
        layout="hnd",
    ),
]


@gpu
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_cuda_rope_kv(backend, case):
    backend("cuda")
    run_case(device="cuda", num_tokens=case.pop("num_tokens", 5), **case)


@gpu
@pytest.mark.parametrize(
    "config", ["32,1", "64,2", "128,4", "512,1", "160,3", "32,1,4", "96,2,4", "128,4,4"]
)
@pytest.mark.parametrize("num_tokens", [1, 33, 257])
@pytest.mark.parametrize("heads", [(6, 2), (5, 1)])  # (5, 1): a group of q, k, and no heads
def test_cuda_launch_configs(backend, monkeypatch, config, num_tokens, heads):
    """Lanes split over several blocks, several tokens per block and four heads (or pieces) per
    thread give the same result."""
    backend("cuda")
    monkeypatch.setenv("SGL_EXT_CUDA_CONFIG", config)
    settings.reload()
    run_case(
        device="cuda",
        dtype=torch.bfloat16,
        num_tokens=num_tokens,
        d=64,
        hq=heads[0],
        hkv=heads[1],
        rot_frac=0.5,
        kv_dtype=torch.float8_e4m3fn,
        scale="tensor",
        layout="nhd",
        num_slots=320,
    )


@gpu
@pytest.mark.parametrize(
    "case",
    [
        dict(dtype=torch.float32),
        dict(dtype=torch.bfloat16, misalign=True, neox=False),
        dict(dtype=torch.bfloat16, d=24),
    ],
    ids=["fp32", "misaligned", "rot-not-16"],
)
def test_unsupported_calls_use_triton(backend, monkeypatch, case):
    """Automatic dispatch runs calls the CUDA kernel cannot take on Triton (still correct);
    forcing the CUDA backend on them is a clear error before any launch."""
    from sgl_ext.cuda import rope_kv as cuda_rope_kv

    launched = []
    monkeypatch.setattr(cuda_rope_kv, "launch", lambda *a, **k: launched.append(1))
    monkeypatch.delenv("SGL_EXT_BACKEND", raising=False)
    settings.reload()
    run_case(device="cuda", **case)
    assert not launched
    backend("cuda")
    with pytest.raises(RuntimeError, match="SGL_EXT_BACKEND=cuda"):
        run_case(device="cuda", **case)


@gpu
def test_default_dispatch_uses_cuda_where_preferred(monkeypatch):
    """Without SGL_EXT_BACKEND the CUDA kernel runs exactly at the preferred token counts
    (none by default: it measured slower than Triton; SGL_EXT_CUDA_TOKENS opts in)."""
    from sgl_ext.cuda import rope_kv as cuda_rope_kv

    monkeypatch.delenv("SGL_EXT_BACKEND", raising=False)

    settings.reload()
    calls = []
    real = cuda_rope_kv.launch
    monkeypatch.setattr(cuda_rope_kv, "launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    for env, want in ((None, 0), ("1,64", 2)):
        if env:
            monkeypatch.setenv("SGL_EXT_CUDA_TOKENS", env)
            settings.reload()
        calls.clear()
        for t in (1, 64, 2048):
            run_case(device="cuda", dtype=torch.bfloat16, num_tokens=t, num_slots=4096)
        assert len(calls) == want


@gpu
def test_cuda_graph_capture_and_pdl_off(backend):
    """The CUDA kernel records into a CUDA graph (its module was loaded before capture) and
    replays equal to eager; enable_pdl=False launches the plain way with the same bits."""
    backend("cuda")
    t, hq, hkv, d = 5, 8, 2, 64
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 100, (t,), generator=g).cuda()
    cs = torch.randn(100, d, generator=g).cuda()
    qkv0 = torch.randn(t, (hq + 2 * hkv) * d, generator=g).bfloat16().cuda()
    loc = torch.tensor([3, -1, 7, 0, 12], device="cuda")
    ks = torch.tensor([0.5], device="cuda")

    def step(qkv, kb, vb, pdl=None):
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views
        arg = FusedSetKVBufferArg(v, kb, vb, ks, 0.25, loc)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, d, cs, True, arg, pdl)

    def fresh():
        kb = torch.full((16, hkv, d), float("nan"), device="cuda").to(torch.float8_e4m3fn)
        return qkv0.clone(), kb, kb.clone()

    eager = fresh()
    step(*eager)
    plain = fresh()
    step(*plain, pdl=False)
    graphed = fresh()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*graphed)
    graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(eager, plain, graphed, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a.view(torch.uint8), c.view(torch.uint8))

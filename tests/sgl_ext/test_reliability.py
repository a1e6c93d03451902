"""Inputs an adversarial run found (issue 21): rejected before anything is written, and fp8
NaN / inf handled alike by every backend."""

from __future__ import annotations

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from tests.sgl_ext.sgl_ext_testutil import bits, make_cos_sin_cache, quant_ref

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _device(name: str) -> str:
    return "cuda" if (HAS_CUDA and name == "triton") else "cpu"


def _small(device: str, dtype=torch.float32, kv_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = {
        "pos": torch.tensor([0, 1]),
        "q": torch.randn(2, 32, generator=g).to(dtype),
        "k": torch.randn(2, 16, generator=g).to(dtype),
        "v": torch.randn(2, 16, generator=g).to(dtype),
        "kb": torch.randn(8, 1, 16, generator=g).to(kv_dtype or dtype),
        "vb": torch.randn(8, 1, 16, generator=g).to(kv_dtype or dtype),
        "loc": torch.tensor([1, 2]),
        "cs": make_cos_sin_cache(4, 16),
    }
    return {k: v.to(device) for k, v in t.items()}


def _expect_rejected(t, exc, name, **changes):
    """The op raises exc naming `name` and leaves every tensor as it was."""
    t = {**t, **changes}
    ks, vs = t.pop("ks", None), t.pop("vs", None)
    snap = {k: v.detach().clone() for k, v in t.items()}
    arg = FusedSetKVBufferArg(t["v"], t["kb"], t["vb"], ks, vs, t["loc"])
    with pytest.raises(exc) as info:
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            t["pos"], t["q"], t["k"], 16, t["cs"], True, arg
        )
    assert name in str(info.value), str(info.value)
    for k, v in t.items():
        assert torch.equal(bits(v.detach()), bits(snap[k])), f"{k} was modified"


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_empty_cos_sin_cache_rejected(backend, backend_name):
    """Issue 21 #1: a 0-row cache used to crash Triton (position clamped to -1)."""
    backend(backend_name)
    t = _small(_device(backend_name))
    _expect_rejected(t, ValueError, "cos_sin_cache", cs=t["cs"][:0])
    _expect_rejected(t, ValueError, "cos_sin_cache", cs=t["cs"][:, :0])


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("value", [1e-300, 1e-45, 1e300, 1e39, 0.0, -0.5, float("inf")])
@pytest.mark.parametrize("which", ["ks", "vs"])
def test_float_scale_must_be_finite_positive_in_float32(backend, backend_name, value, which):
    """Issue 21 #2: fine in float64, 0 or inf in float32 (or its fp32 reciprocal inf)."""
    backend(backend_name)
    t = _small(_device(backend_name), torch.bfloat16, torch.float8_e4m3fn)
    name = {"ks": "k_scale", "vs": "v_scale"}[which]
    _expect_rejected(t, ValueError, name, **{which: value})


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("name", ["q", "k", "kb", "vb"])
def test_written_tensor_requiring_grad_rejected(backend, backend_name, name):
    """Issue 21 #9: native used to raise only after q was rotated; Triton accepted it."""
    backend(backend_name)
    t = _small(_device(backend_name))
    arg_name = {"q": "query", "k": "key", "kb": "k_buffer", "vb": "v_buffer"}[name]
    _expect_rejected(t, ValueError, arg_name, **{name: t[name].clone().requires_grad_()})


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("name", ["q", "k", "kb", "vb"])
def test_written_overlapping_view_rejected(backend, backend_name, name):
    """Expanded (stride-0) views of written tensors: two tokens/slots would share memory."""
    backend(backend_name)
    t = _small(_device(backend_name))
    x = t[name]
    expanded = x[:1].expand(x.shape)
    arg_name = {"q": "query", "k": "key", "kb": "k_buffer", "vb": "v_buffer"}[name]
    _expect_rejected(t, ValueError, arg_name, **{name: expanded})
    if name in ("kb", "vb"):  # slots overlapping by half a row
        half = x.clone().as_strided(x.shape, (8, 16, 1))
        _expect_rejected(t, ValueError, arg_name, **{name: half})


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_strided_index_vectors_rejected(backend, backend_name):
    """The kernels read positions / cache_loc as contiguous vectors."""
    backend(backend_name)
    t = _small(_device(backend_name))
    _expect_rejected(t, ValueError, "positions", pos=t["pos"].repeat(2)[::2])
    _expect_rejected(t, ValueError, "cache_loc", loc=t["loc"].repeat(2)[::2])


NONFINITE = [float("nan"), -float("nan"), float("inf"), -float("inf"), 1e6, -1e6, 1.0, -2.0]


def _nonfinite_store(kv_dtype, device):
    """V = NONFINITE (twice, 16 dims) stored to an fp8 cache with scale 1; returns the row."""
    v = torch.tensor(NONFINITE * 2, device=device).view(1, 16)
    q, k = torch.zeros(1, 16, device=device), torch.ones(1, 16, device=device)
    kb = torch.zeros(4, 1, 16, device=device).to(kv_dtype)
    vb = torch.zeros_like(kb)
    loc = torch.tensor([2], device=device)
    pos = torch.tensor([0], device=device)
    cs = make_cos_sin_cache(4, 16).to(device)
    arg = FusedSetKVBufferArg(v, kb, vb, 1.0, 1.0, loc)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 16, cs, True, arg)
    return vb[2, 0].float().cpu()


def _expected_nonfinite(kv_dtype) -> torch.Tensor:
    m = torch.finfo(kv_dtype).max
    inf = float("inf")
    inf_out = inf if kv_dtype == torch.float8_e5m2 else float("nan")
    ninf_out = -inf if kv_dtype == torch.float8_e5m2 else float("nan")
    row = [float("nan"), float("nan"), inf_out, ninf_out, m, -m, 1.0, -2.0]
    return torch.tensor(row * 2)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok]), (got, want)


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_nan_stays_nan_and_only_finite_values_saturate(backend, backend_name, kv_dtype):
    """Issue 21 #3: NaN in gives NaN in the cache on every backend (it used to become -448 or
    -57344 under the Triton interpreter); finite values saturate; inf is not saturated (e5m2
    keeps it, e4m3fn has no inf: NaN)."""
    backend(backend_name)
    got = _nonfinite_store(kv_dtype, _device(backend_name))
    _assert_same(got, _expected_nonfinite(kv_dtype))


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_nonfinite_compiled_triton_matches_native(backend, kv_dtype):
    """The compiled kernel (the cast saturates in hardware) stores the same as native."""
    backend("triton")
    got = _nonfinite_store(kv_dtype, "cuda")
    backend("native")
    want = _nonfinite_store(kv_dtype, "cuda")
    _assert_same(got, want)
    _assert_same(got, _expected_nonfinite(kv_dtype))


# ----------------------------------------------------------------------------- issue 50
def _qk_norm_call(t, eps, qw=None, kw=None):
    w = torch.ones(16, dtype=t["q"].dtype, device=t["q"].device)
    arg = FusedSetKVBufferArg(t["v"], t["kb"], t["vb"], None, None, t["loc"])
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
        t["pos"], t["q"], t["k"], 16, t["cs"], w if qw is None else qw, w if kw is None else kw,
        eps, True, arg,
    )  # fmt: skip


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize(
    ("eps", "exc"),
    [
        (0.0, ValueError),
        (-1e-6, ValueError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (1e-50, ValueError),  # 0 in float32: an all-zero head gave NaN
        (1e-40, ValueError),  # subnormal in float32: a GPU may flush it to 0
        (1e39, ValueError),  # inf in float32: an all-zero K cache
        (2**2000, ValueError),  # OverflowError before
        (True, TypeError),
        ("1e-6", TypeError),
    ],
)
def test_qk_norm_eps_checked_like_the_scales(backend, backend_name, eps, exc):
    backend(backend_name)
    t = _small(_device(backend_name), torch.bfloat16)
    snap = {k: v.clone() for k, v in t.items()}
    with pytest.raises(exc, match="eps"):
        _qk_norm_call(t, eps)
    for k, v in t.items():
        assert torch.equal(bits(v), bits(snap[k])), f"{k} was modified"
    _qk_norm_call(t, 1e-6)  # a normal eps still runs
    _qk_norm_call(t, 2.0**-126)  # the smallest normal float32 too


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("which", ["ks", "vs"])
def test_huge_int_scale_is_a_value_error(backend, backend_name, which):
    """float(2**2000) raised OverflowError out of the scale check."""
    backend(backend_name)
    t = _small(_device(backend_name), torch.bfloat16, torch.float8_e4m3fn)
    name = {"ks": "k_scale", "vs": "v_scale"}[which]
    _expect_rejected(t, ValueError, name, **{which: 2**2000})


SPARSE = {"pos": "positions", "q": "query", "k": "key", "cs": "cos_sin_cache", "v": "value"}
SPARSE |= {"kb": "k_buffer", "vb": "v_buffer", "loc": "cache_loc"}


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("name", [*SPARSE, "ks"])
def test_sparse_tensor_is_a_type_error_naming_it(backend, backend_name, name):
    """A sparse tensor raised RuntimeError ("doesn't have storage") from the plan key."""
    backend(backend_name)
    t = _small(_device(backend_name))
    snap = {k: v.clone() for k, v in t.items()}
    ks = None
    if name == "ks":
        ks = torch.ones(1, device=t["q"].device).to_sparse()
    a = {**t, name: t[name].to_sparse()} if name != "ks" else t
    arg = FusedSetKVBufferArg(a["v"], a["kb"], a["vb"], ks, None, a["loc"])
    with pytest.raises(TypeError, match=SPARSE.get(name, "k_scale")):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            a["pos"], a["q"], a["k"], 16, a["cs"], True, arg
        )
    for k, v in t.items():  # the dense ones: untouched
        assert torch.equal(bits(v), bits(snap[k])), f"{k} was modified"


def test_sparse_norm_weight_and_set_kv_key_are_type_errors():
    t = _small("cpu", torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="k_norm_weight"):
        _qk_norm_call(t, 1e-6, kw=w.to_sparse())
    for name in ("k", "v", "kb", "loc"):
        a = {**t, name: t[name].to_sparse()}
        with pytest.raises(TypeError, match=SPARSE[name]):
            sgl_ext.set_kv_buffer(a["k"], a["v"], a["kb"], a["vb"], a["loc"], head_size=16)


def _store_16bit(dtype, device, scales, fused, seed):
    """K and V of odd-sized random rows stored into 16-bit caches with scales: (the key after
    the op, its slots, kb, vb)."""
    g = torch.Generator().manual_seed(seed)
    T, H, D = 37, 3, 16
    k = torch.randn(T, H * D, generator=g).to(dtype).to(device)
    v = (torch.randn(T, H, D, generator=g) * 7).to(dtype).to(device)
    kb = torch.zeros(53, H, D, dtype=dtype, device=device)
    vb = torch.zeros(53, H, D, dtype=dtype, device=device)
    loc = torch.randperm(53, generator=g)[:T].to(device)
    ks, vs = (s.to(device) if isinstance(s, torch.Tensor) else s for s in scales)
    if not fused:
        sgl_ext.set_kv_buffer(k, v, kb, vb, loc, ks, vs, head_size=D)
        return k, loc, kb, vb
    q = torch.randn(T, 2 * H * D, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 40, (T,), generator=g).to(device)
    cs = make_cos_sin_cache(40, D).to(device)
    arg = FusedSetKVBufferArg(v, kb, vb, ks, vs, loc)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q, k, D, cs, True, arg)
    return k, loc, kb, vb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", [(0.37, 1.7), (torch.tensor([3.1]), torch.tensor([0.3]))])
@pytest.mark.parametrize("fused", [False, True])
def test_16bit_cache_with_scales_same_bits_on_every_backend(backend, dtype, scales, fused):
    """The quantise path ended in a plain cast, which the interpreter truncates for bf16: a
    bf16 cache with a scale held other K and V bits than native. Triton (interpreted on CPU,
    compiled on a GPU) must store exactly native's bits, and each backend's K cache must be
    exactly its own returned key, quantised."""
    device = _device("triton")
    backend("triton")
    got = _store_16bit(dtype, device, scales, fused, seed=5)
    backend("native")
    want = _store_16bit(dtype, device, scales, fused, seed=5)
    assert torch.equal(bits(got[3]), bits(want[3])), "V bits differ"
    assert got[3].any() and got[2].any()
    for k, loc, kb, _ in (got, want):  # the cache holds the returned key, quantised
        ks = scales[0].to(device) if isinstance(scales[0], torch.Tensor) else scales[0]
        want_k = quant_ref(k.view(kb[loc].shape), dtype, ks)
        assert torch.equal(bits(kb[loc]), bits(want_k)), "K cache is not the key, quantised"
    # The same key gives the same K cache. (The fused op's rotated key itself may differ by
    # an ulp between backends, e.g. the interpreter's bf16 cast of the RoPE output truncates:
    # that is the rotation, not the KV write; without RoPE the keys are the inputs.)
    if not fused:
        assert torch.equal(bits(got[0]), bits(want[0]))
    if torch.equal(bits(got[0]), bits(want[0])):
        assert torch.equal(bits(got[2]), bits(want[2])), "K bits differ"

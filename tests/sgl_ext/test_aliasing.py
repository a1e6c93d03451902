"""Aliasing between the ops' arguments (issue 50): a written tensor that shares memory with
another argument is a ValueError naming both, raised before any write, on every backend and
under an unchanged plan key; views of one buffer in disjoint places (qkv column views, the
cross-layer KV layout) stay legal. The overlap test itself (`_alias.views_disjoint`) is checked
against the element sets of random strided views."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from sgl_ext._alias import _view, alias_guard, views_disjoint
from tests.sgl_ext.sgl_ext_testutil import bits, make_cos_sin_cache

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
T, HQ, HKV, D = 5, 4, 2, 16


def _dev(backend_name: str) -> str:
    return "cuda" if HAS_CUDA and backend_name == "triton" else "cpu"


# ----------------------------------------------------------------------------- the overlap test
def _bytes(t: torch.Tensor) -> set[int]:
    """Every byte address t touches (ground truth, by enumeration)."""
    es = t.element_size()
    idx = itertools.product(*(range(n) for n in t.shape))
    base = t.data_ptr()
    return {
        base + es * sum(i * s for i, s in zip(ix, t.stride(), strict=True)) + b
        for ix in idx
        for b in range(es)
    }


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    va, vb = _view("a", 0, True, a), _view("b", 1, False, b)
    return va is None or vb is None or views_disjoint(va, vb)


view_shape = st.lists(st.tuples(st.integers(1, 4), st.integers(0, 24)), min_size=1, max_size=3)


@settings(max_examples=300, deadline=None)
@given(a=view_shape, b=view_shape, oa=st.integers(0, 40), ob=st.integers(0, 40), es=st.data())
def test_views_disjoint_is_sound_on_random_strided_views(a, b, oa, ob, es):
    """Whenever it says disjoint, the element sets are disjoint (any sizes, strides, offsets,
    element sizes; expanded stride-0 dims too)."""
    dtype_a = es.draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
    dtype_b = es.draw(st.sampled_from([torch.uint8, torch.bfloat16, torch.float32]))
    base = torch.zeros(4096, dtype=torch.uint8)

    def make(spec, off, dtype):
        es_ = torch.empty((), dtype=dtype).element_size()
        view = base[off * es_ :].view(dtype)
        sizes, strides = zip(*spec, strict=True)
        return view.as_strided(sizes, strides)

    x, y = make(a, oa, dtype_a), make(b, ob, dtype_b)
    if _disjoint(x, y):
        assert not _bytes(x) & _bytes(y)


@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("three_d", [False, True])
def test_qkv_column_views_are_disjoint(t, three_d):
    qkv = torch.zeros(t, (HQ + 2 * HKV) * D, dtype=torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], -1)
    if three_d:
        q, k, v = (x.unflatten(-1, (-1, D)) for x in (q, k, v))
    for x, y in ((q, k), (q, v), (k, v)):
        assert _disjoint(x, y) and not _bytes(x) & _bytes(y)
    assert not _disjoint(q, qkv[:, HQ * D - 1 : HQ * D + 1])  # one column of q and of k


@pytest.mark.parametrize("page_size", [1, 4])
def test_cross_layer_kv_views_are_disjoint(page_size):
    """[pages, layers, 2, page, H, D]: K and V of a layer, and of different layers."""
    buf = torch.zeros(3, 2, 2, page_size, HKV, D, dtype=torch.float16)
    view = (lambda x: x[:, :, 0]) if page_size == 1 else (lambda x: x)
    k0, v0, k1 = view(buf[:, 0, 0]), view(buf[:, 0, 1]), view(buf[:, 1, 0])
    for x, y in ((k0, v0), (k0, k1), (v0, k1)):
        assert _disjoint(x, y) and not _bytes(x) & _bytes(y)
    assert not _disjoint(k0, buf[:, 0].flatten(1, 2))


def test_alias_guard_holds_for_the_same_offsets_only():
    qkv = torch.zeros(3, 64)
    q, k = qkv[:, :32], qkv[:, 32:48]
    kb, vb = torch.zeros(8, 16), torch.zeros(8, 16)
    guard = alias_guard(
        [("query", 0, True, q), ("key", 1, True, k), ("k_buffer", 2, True, kb), ("v", 3, True, vb)]
    )
    ptrs = [x.data_ptr() for x in (q, k, kb, vb)]
    assert guard.holds(ptrs)
    qkv2, kb2, vb2 = torch.zeros(3, 64), torch.zeros(8, 16), torch.zeros(8, 16)
    assert guard.holds([qkv2.data_ptr(), qkv2[:, 32:].data_ptr(), kb2.data_ptr(), vb2.data_ptr()])
    assert not guard.holds([ptrs[0], ptrs[1], ptrs[2], ptrs[2]])  # v_buffer is k_buffer now
    assert not guard.holds([ptrs[0], ptrs[0] + 4, ptrs[2], ptrs[3]])  # key moved into query
    with pytest.raises(ValueError, match="k_buffer and v overlap"):
        alias_guard([("k_buffer", 2, True, kb), ("v", 3, True, kb)])
    # read-only arguments may share memory (k_scale being v_scale, say)
    s = torch.ones(1)
    alias_guard([("k_scale", 0, False, s), ("v_scale", 1, False, s), ("key", 2, True, k)])


# ----------------------------------------------------------------------------- the ops
def _args(device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    kv = torch.randn(2, 16, HKV, D, generator=g).to(dtype)
    a = dict(
        positions=torch.randint(0, 20, (T,), generator=g),
        qkv=qkv,
        cos_sin_cache=make_cos_sin_cache(20, D),
        kv=kv,
        cache_loc=torch.tensor([1, 2, 3, 9, 5]),
    )
    a = {k: v.to(device) for k, v in a.items()}
    q, k, v = a["qkv"].split([HQ * D, HKV * D, HKV * D], -1)
    a.update(query=q, key=k, value=v, k_buffer=a["kv"][0], v_buffer=a["kv"][1])
    return a


def _rope(a, **changes):
    a = {**a, **changes}
    arg = FusedSetKVBufferArg(
        a["value"], a["k_buffer"], a["v_buffer"], None, None, a["cache_loc"]
    )  # fmt: skip
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(
        a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], True, arg
    )


def _qk_norm(a, **changes):
    a = {**a, **changes}
    w = a.get("k_norm_weight", torch.ones(D, device=a["key"].device))
    arg = FusedSetKVBufferArg(a["value"], a["k_buffer"], a["v_buffer"], None, None, a["cache_loc"])
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
        a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], w.clone(), w, 1e-6, True, arg
    )


def _set_kv(a, **changes):
    a = {**a, **changes}
    sgl_ext.set_kv_buffer(
        a["key"], a["value"], a["k_buffer"], a["v_buffer"], a["cache_loc"], head_size=D
    )


def _expect_rejected(op, a, names, **changes):
    """op raises ValueError naming both arguments, and no tensor changes."""
    snap = {k: bits(v).clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    snap |= {f"new {k}": bits(v).clone() for k, v in changes.items()}
    with pytest.raises(ValueError, match="overlap") as info:
        op(a, **changes)
    for n in names:
        assert n in str(info.value), str(info.value)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(bits(v), snap[k]), f"{k} was modified"
    for k, v in changes.items():
        assert torch.equal(bits(v), snap[f"new {k}"]), f"{k} was modified"


def _shifted(a, name, by):
    """A view shaped like the key that starts `by` elements after a[name], in the same rows."""
    t, k = a[name], a["key"]
    return t.as_strided(k.shape, k.stride(), t.storage_offset() + by)


BAD = [
    # (changes as functions of the args, the names the error must carry)
    (lambda a: {"v_buffer": a["k_buffer"]}, ("k_buffer", "v_buffer")),
    (lambda a: {"v_buffer": a["kv"].view(-1, HKV, D)[8:24]}, ("k_buffer", "v_buffer")),
    (lambda a: {"value": a["key"]}, ("key", "value")),
    (lambda a: {"value": _shifted(a, "key", 8)}, ("key", "value")),
    (lambda a: {"key": _shifted(a, "query", HQ * D - 8)}, ("query", "key")),
    (lambda a: {"k_buffer": a["qkv"].view(-1)[: 16 * HKV * D].view(16, HKV, D)}, ("k_buffer",)),
    (lambda a: {"k_buffer": a["kv"].view(-1, HKV, D)[16:32]}, ("k_buffer", "v_buffer")),
]


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("op", [_rope, _qk_norm], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("row", range(len(BAD)))
def test_aliased_arguments_rejected_before_any_write(backend, backend_name, op, row):
    backend(backend_name)
    a = _args(_dev(backend_name))
    make, names = BAD[row]
    _expect_rejected(op, a, names, **make(a))


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_set_kv_buffer_aliasing(backend, backend_name):
    """key and value are only read by set_kv_buffer: one tensor for both is fine; the
    buffers it writes must not meet each other or its inputs."""
    backend(backend_name)
    a = _args(_dev(backend_name))
    _expect_rejected(_set_kv, a, ("k_buffer", "v_buffer"), v_buffer=a["k_buffer"])
    in_qkv = a["qkv"].view(-1)[: 16 * HKV * D].view(16, HKV, D)  # rows 0-3 of qkv
    _expect_rejected(_set_kv, a, ("k_buffer", "key"), k_buffer=in_qkv)
    _set_kv(a, value=a["key"])
    loc = a["cache_loc"]
    assert torch.equal(a["v_buffer"][loc], a["key"].view(T, HKV, D))


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("op", [_rope, _qk_norm, _set_kv], ids=["rope", "qk_norm", "set_kv"])
def test_disjoint_views_of_one_buffer_stay_legal(backend, backend_name, op):
    """q/k/v column views of one qkv buffer and cross-layer K/V views give exactly what copies
    in separate buffers give."""
    backend(backend_name)
    dev = _dev(backend_name)
    layout = torch.zeros(8, 3, 2, 4, HKV, D, device=dev)  # [pages, layers, kv, page, H, D]
    a = _args(dev)
    a.update(k_buffer=layout[:, 1, 0], v_buffer=layout[:, 1, 1])
    b = _args(dev)
    b.update(k_buffer=layout[:, 1, 0].clone(), v_buffer=layout[:, 1, 1].clone())
    b.update(query=b["query"].clone(), key=b["key"].clone(), value=b["value"].clone())
    op(a)
    op(b)
    for name in ("query", "key", "k_buffer", "v_buffer"):
        assert torch.equal(bits(a[name]), bits(b[name])), name
    assert not layout[:, 0].any() and not layout[:, 2].any()  # other layers untouched


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("op", [_rope, _qk_norm, _set_kv], ids=["rope", "qk_norm", "set_kv"])
def test_aliasing_under_an_unchanged_plan_key(backend, backend_name, op):
    """The plan key holds data_ptr() % 16, not the pointer: a call that aliases where an
    earlier call with the same metadata did not (v_buffer now k_buffer, value now key) is
    still rejected, and a legal call after it runs."""
    backend(backend_name)
    a = _args(_dev(backend_name))
    op(a)
    op(a)  # a plan hit (and, on a GPU, a launch from C)
    _expect_rejected(op, a, ("k_buffer", "v_buffer"), v_buffer=a["k_buffer"])
    if op is not _set_kv:
        _expect_rejected(op, a, ("key", "value"), value=a["key"])
    b = _args(_dev(backend_name), seed=1)
    op(b)  # fresh buffers, the same metadata: legal again
    op(a)


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_apply_rope_native_reference_rejects_aliasing(backend_name):
    from sgl_ext.kv_cache import set_kv_buffer_native
    from sgl_ext.rope import apply_rope_native

    a = _args("cpu")
    arg = FusedSetKVBufferArg(a["value"], a["k_buffer"], a["k_buffer"], None, None, a["cache_loc"])
    with pytest.raises(ValueError, match="k_buffer and v_buffer"):
        apply_rope_native(a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], True, arg)
    with pytest.raises(ValueError, match="k_buffer and v_buffer"):
        set_kv_buffer_native(a["key"], a["value"], a["k_buffer"], a["k_buffer"], a["cache_loc"])


def test_qkv_proj_with_rope_kv_rejects_aliasing():
    from sgl_ext.gemm import GemmConfig

    g = torch.Generator().manual_seed(0)
    n = (HQ + 2 * HKV) * D
    x, w = torch.randn(T, 32, generator=g), torch.randn(n, 32, generator=g)
    pos, cs = torch.randint(0, 20, (T,), generator=g), make_cos_sin_cache(20, D)
    out = torch.zeros(T, n)
    kb, vb = torch.zeros(16, HKV, D), torch.zeros(16, HKV, D)
    loc = torch.tensor([1, 2, 3, 4, 5])
    cfg = GemmConfig(block_n=4, block_k=32, num_warps=1, num_stages=2)

    def call(kb_, vb_, x_=x):
        v = out[:, n - HKV * D :]
        arg = FusedSetKVBufferArg(v, kb_, vb_, None, None, loc)
        sgl_ext.qkv_proj_with_rope_kv(x_, w, None, pos, cs, D, HKV, out, True, arg, cfg)

    call(kb, vb)
    before = [bits(t).clone() for t in (out, kb, vb, x)]
    with pytest.raises(ValueError, match="k_buffer and v_buffer"):
        call(kb, kb)
    xs = torch.zeros(16 * HKV * D)  # x's storage doubling as a KV buffer
    with pytest.raises(ValueError, match="k_buffer and x overlap"):
        call(xs.view(16, HKV, D), vb, xs[: T * 32].view(T, 32))
    for t, b in zip((out, kb, vb, x), before, strict=True):
        assert torch.equal(bits(t), b)

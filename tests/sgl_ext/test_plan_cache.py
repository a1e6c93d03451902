"""The ops check once per distinct metadata: a changed input is still caught after a cached
call, and a valid change (another plan) still computes the right result."""

from __future__ import annotations

import pytest
import torch

import sgl_ext
from sgl_ext import kv_cache, rope
from tests.sgl_ext.sgl_ext_testutil import bits, quant_ref, rope_ref
from tests.sgl_ext.test_validation import call, make_args

HAS_CUDA = torch.cuda.is_available()
T, HQ, HKV, D = 5, 4, 2, 16


def _device(name: str) -> str:
    return "cuda" if (HAS_CUDA and name == "triton") else "cpu"


class _LookAlike:
    """Has FusedSetKVBufferArg's fields but is not one."""

    def __init__(self, a):
        self.value, self.k_buffer, self.v_buffer = a["value"], a["k_buffer"], a["v_buffer"]
        self.k_scale, self.v_scale, self.cache_loc = None, None, a["cache_loc"]


# (argument changed, change, exception, name in the message); each after a cached good call
CHANGED = [
    ("key", lambda a: a["key"].half(), TypeError, "key"),
    ("positions", lambda a: a["positions"][:3], ValueError, "query"),
    ("positions", lambda a: a["positions"].int()[::1].repeat(2)[::2], ValueError, "positions"),
    ("query", lambda a: a["query"].requires_grad_(), ValueError, "query"),
    ("key", lambda a: a["key"][:1].expand(T, HKV * D), ValueError, "key"),
    ("k_buffer", lambda a: a["k_buffer"][:16], ValueError, "v_buffer"),
    ("v_buffer", lambda a: a["v_buffer"].transpose(1, 2), ValueError, "v_buffer"),
    ("k_buffer", lambda a: a["k_buffer"].requires_grad_(), ValueError, "k_buffer"),
    ("v_buffer", lambda a: a["v_buffer"][:, :1].expand(32, HKV, D), ValueError, "v_buffer"),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"][:0], ValueError, "cos_sin_cache"),
    ("cache_loc", lambda a: a["cache_loc"].float(), TypeError, "cache_loc"),
    ("k_scale", lambda a: 1e-45, ValueError, "k_scale"),
    ("v_scale", lambda a: True, TypeError, "v_scale"),
    ("head_size", lambda a: float(D), ValueError, "head_size"),
    ("is_neox", lambda a: 1, TypeError, "is_neox"),
]


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("row", CHANGED, ids=[f"{r[0]}-{i}" for i, r in enumerate(CHANGED)])
def test_changed_input_caught_after_cached_call(backend, backend_name, row):
    name, make, exc, named = row
    backend(backend_name)
    dev = _device(backend_name)
    for _ in range(2):  # the second call is a cache hit (and, on CUDA, a direct launch)
        call(make_args(dev))
    a = make_args(dev)
    a[name] = make(a)
    snapshot = {k: v.detach().clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc) as info:
        call(a)
    assert named in str(info.value), str(info.value)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(bits(v.detach()), bits(snapshot[k])), f"{k} was modified"


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_lookalike_argument_rejected_after_cached_call(backend, backend_name):
    backend(backend_name)
    a = make_args(_device(backend_name))
    call(a)
    with pytest.raises(TypeError, match="fused_set_kv_buffer_arg"):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], True, _LookAlike(a)
        )


def _check_call(a, neox=True):
    """Run the fused op on a and compare q, k, the K and V cache rows to the references."""
    pos, q0, k0, v = a["positions"], a["query"].clone(), a["key"].clone(), a["value"]
    kb, vb, loc = a["k_buffer"], a["v_buffer"], a["cache_loc"]
    ks, vs = a["k_scale"], a["v_scale"]
    call(a)
    cs = a["cos_sin_cache"].cpu()
    tol = 2e-2
    q_ref = rope_ref(pos.cpu(), q0.cpu(), D, cs, neox)
    k_ref = rope_ref(pos.cpu(), k0.cpu(), D, cs, neox)
    torch.testing.assert_close(a["query"].cpu().double().view(T, -1, D), q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(a["key"].cpu().double().view(T, -1, D), k_ref, atol=tol, rtol=tol)
    k_rows = a["key"].reshape(T, HKV, D)
    v_rows = v.reshape(T, HKV, D)
    for i in range(T):
        s = int(loc[i])
        want_k = quant_ref(k_rows[i], kb.dtype, ks)
        want_v = quant_ref(v_rows[i], vb.dtype, vs)
        assert torch.equal(bits(kb[s]).cpu(), bits(want_k).cpu())
        assert torch.equal(bits(vb[s]).cpu(), bits(want_v).cpu())


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_valid_changes_make_new_plans(backend, backend_name):
    """Scale values, index dtypes, fp8 buffers and a misaligned query after cached calls."""
    backend(backend_name)
    dev = _device(backend_name)
    _check_call(make_args(dev))
    a = make_args(dev)
    a["k_buffer"] = a["k_buffer"].to(torch.float8_e4m3fn)
    a["v_buffer"] = a["v_buffer"].to(torch.float8_e4m3fn)
    for ks in (0.5, 0.25, 2.0):
        b = dict(a, k_scale=ks, v_scale=1.0 / ks)
        b["query"], b["key"] = a["query"].clone(), a["key"].clone()
        _check_call(b)
    a = make_args(dev)
    a["cache_loc"] = a["cache_loc"].int()
    a["positions"] = a["positions"].int()
    _check_call(a)
    # query rows off a 16-byte boundary (a view one element into a larger buffer)
    a = make_args(dev)
    big = torch.empty(T * HQ * D + 1, dtype=a["query"].dtype, device=dev)
    q = big[1:].view(T, HQ * D)
    q.copy_(a["query"])
    a["query"] = q
    _check_call(a)


@pytest.mark.parametrize("backend_name", ["native", "triton"])
def test_set_kv_buffer_changed_input_caught_after_cached_call(backend, backend_name):
    backend(backend_name)
    a = make_args(_device(backend_name))
    args = [a["key"], a["value"], a["k_buffer"], a["v_buffer"], a["cache_loc"]]
    for _ in range(2):
        sgl_ext.set_kv_buffer(*args)
    for i, bad, exc, name in (
        (2, a["k_buffer"][:16], ValueError, "v_buffer"),
        (4, a["cache_loc"][:2], ValueError, "cache_loc"),
        (3, a["v_buffer"].float(), TypeError, "v_buffer"),
        (1, a["value"][:1].expand(T, HKV * D), None, None),  # a valid (read-only) expanded view
    ):
        changed = list(args)
        changed[i] = bad
        if exc is None:
            sgl_ext.set_kv_buffer(*changed)
            want = a["value"][0].view(HKV, D)
            for s in a["cache_loc"].tolist():
                assert torch.equal(a["v_buffer"][s], want)
            continue
        before = a["k_buffer"].clone()
        with pytest.raises(exc, match=name):
            sgl_ext.set_kv_buffer(*changed)
        assert torch.equal(a["k_buffer"], before)
    with pytest.raises(ValueError, match="v_scale"):
        sgl_ext.set_kv_buffer(*args, 0.5, 1e300)


def test_plans_are_cached_and_dropped_on_settings_change(backend):
    backend("native")
    rope._PLANS.clear()
    a = make_args()
    call(a)
    call(make_args())
    assert len(rope._PLANS) == 1
    sgl_ext.set_kv_buffer(a["key"], a["value"], a["k_buffer"], a["v_buffer"], a["cache_loc"])
    assert len(kv_cache._PLANS) >= 1
    sgl_ext.set_debug_checks(True)
    try:
        assert not rope._PLANS and not kv_cache._PLANS
    finally:
        sgl_ext.set_debug_checks(None)


def test_fused_arg_scales_as_tensors_or_floats_share_nothing(backend):
    """A tensor scale and a float scale of the same value are different plans (modes)."""
    backend("native")
    a = make_args()
    a["k_buffer"] = a["k_buffer"].to(torch.float8_e5m2)
    a["v_buffer"] = a["v_buffer"].to(torch.float8_e5m2)
    for ks in (0.5, torch.tensor(0.5), 0.5):
        b = dict(a, k_scale=ks, v_scale=ks)
        b["query"], b["key"] = a["query"].clone(), a["key"].clone()
        _check_call(b)


# (argument changed, change, exception, name in the message) for the q/k-norm op
QK_CHANGED = [
    ("q_norm_weight", lambda a: a["q_norm_weight"].float(), TypeError, "q_norm_weight"),
    ("k_norm_weight", lambda a: a["k_norm_weight"][:-1], ValueError, "k_norm_weight"),
    ("k_norm_weight", lambda a: a["k_norm_weight"][:1].expand(D), ValueError, "k_norm_weight"),
    ("eps", lambda a: -1e-6, ValueError, "eps"),
    ("eps", lambda a: 1, None, None),  # an int eps is valid: another plan
    ("key", lambda a: a["key"][:1].expand(T, HKV * D), ValueError, "key"),
    ("k_buffer", lambda a: a["k_buffer"][:16], ValueError, "v_buffer"),
]


def _qk_call(a):
    arg = sgl_ext.FusedSetKVBufferArg(
        a["value"], a["k_buffer"], a["v_buffer"], None, None, a["cache_loc"]
    )
    sgl_ext.apply_qk_norm_rope_with_cos_sin_cache_inplace(
        a["positions"],
        a["query"],
        a["key"],
        D,
        a["cos_sin_cache"],
        a["q_norm_weight"],
        a["k_norm_weight"],
        a["eps"],
        True,
        arg,
    )


def _qk_args(dev):
    a = make_args(dev)
    g = torch.Generator().manual_seed(3)
    for name in ("q_norm_weight", "k_norm_weight"):
        a[name] = (torch.rand(D, generator=g) + 0.5).to(a["query"].dtype).to(dev)
    a["eps"] = 1e-6
    return a


@pytest.mark.parametrize("row", QK_CHANGED, ids=[f"{r[0]}-{i}" for i, r in enumerate(QK_CHANGED)])
def test_qk_norm_changed_input_caught_after_cached_call(backend, row):
    """The q/k-norm op's key covers its weights and eps as well as the RoPE op's arguments."""
    name, make, exc, named = row
    backend("native")
    for _ in range(2):  # the second call is a cache hit
        _qk_call(_qk_args("cpu"))
    a = _qk_args("cpu")
    a[name] = make(a)
    if exc is None:
        _qk_call(a)
        return
    snapshot = {k: v.detach().clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(exc) as info:
        _qk_call(a)
    assert named in str(info.value), str(info.value)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(bits(v.detach()), bits(snapshot[k])), f"{k} was modified"


def test_key_pieces():
    """kv_key / scale_key: every piece of metadata a check reads changes the key; a float
    subclass (e.g. numpy.float64) or any non-tensor scale is not keyed (AttributeError)."""
    from sgl_ext._plans import kv_key, scale_key

    a = make_args()
    base = (a["value"], a["k_buffer"], a["v_buffer"], a["cache_loc"], None, None, 7)
    key, ptrs = kv_key(*base)
    kb = a["k_buffer"]
    n_slots = kb.shape[0]
    assert ptrs[:4] == tuple(t.data_ptr() for t in base[:4]) and ptrs[4:] == (7, 7)
    variants = [
        (0, a["value"].view(T, HKV, D)),  # shape
        (1, torch.zeros(n_slots, HKV + 1, D, dtype=kb.dtype)[:, :HKV]),  # strides
        (1, kb.half()),  # dtype
        (1, kb.detach().requires_grad_()),  # requires_grad
        (2, torch.zeros(kb.numel() + 1, dtype=kb.dtype)[1:].view(kb.shape)),  # data_ptr % 16
        (3, a["cache_loc"].int()),
        (4, 0.5),
        (5, torch.tensor(0.5)),
    ]
    for i, t in variants:
        changed = list(base)
        changed[i] = t
        assert kv_key(*changed)[0] != key, i
    assert scale_key(0.5, 7) == ((float, 0.5), 7) and scale_key(0.5, 7) != scale_key(0.25, 7)
    s = torch.tensor(2.0)
    assert scale_key(s, 7) == ((s.dtype, s.shape, s.device, s.data_ptr() & 15), s.data_ptr())

    class F(float):
        pass

    for bad in (F(0.5), "0.5"):
        with pytest.raises(AttributeError):
            scale_key(bad, 7)

"""Bad input raises a clear ValueError/TypeError naming the argument and touches nothing."""

from __future__ import annotations

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from tests.sgl_ext.sgl_ext_testutil import bits, make_cos_sin_cache

T, HQ, HKV, D = 5, 4, 2, 16


def make_args(device="cpu"):
    g = torch.Generator().manual_seed(3)
    args = dict(
        positions=torch.randint(0, 20, (T,), generator=g),
        query=torch.randn(T, HQ * D, generator=g).bfloat16(),
        key=torch.randn(T, HKV * D, generator=g).bfloat16(),
        head_size=D,
        cos_sin_cache=make_cos_sin_cache(20, D),
        is_neox=True,
        value=torch.randn(T, HKV * D, generator=g).bfloat16(),
        k_buffer=torch.randn(32, HKV, D, generator=g).bfloat16(),
        v_buffer=torch.randn(32, HKV, D, generator=g).bfloat16(),
        k_scale=None,
        v_scale=None,
        cache_loc=torch.tensor([1, 2, 3, 4, 5]),
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def call(a):
    arg = FusedSetKVBufferArg(
        a["value"], a["k_buffer"], a["v_buffer"], a["k_scale"], a["v_scale"], a["cache_loc"]
    )
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(
        a["positions"], a["query"], a["key"], a["head_size"], a["cos_sin_cache"], a["is_neox"], arg
    )


BAD = [
    ("positions", lambda a: a["positions"].float(), TypeError),
    ("positions", lambda a: a["positions"].view(T, 1), ValueError),
    ("positions", lambda a: a["positions"][:3], ValueError, "query"),  # T mismatch: names query
    ("query", lambda a: a["query"].to(torch.int32), TypeError),
    ("query", lambda a: a["query"][:, :-3], ValueError),  # not a multiple of head_size
    ("query", lambda a: a["query"].view(T, HQ, D)[:, :, ::2], ValueError),  # wrong head dim
    ("key", lambda a: a["key"].half(), TypeError),
    ("key", lambda a: a["key"].view(T, HKV * D, 1), ValueError),
    ("head_size", lambda a: 0, ValueError),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"].double(), TypeError),
    ("cos_sin_cache", lambda a: a["cos_sin_cache"][:, :7], ValueError),  # odd rotary_dim
    ("cos_sin_cache", lambda a: make_cos_sin_cache(20, 2 * D), ValueError),  # > head_size
    ("is_neox", lambda a: 1, TypeError),
    ("value", lambda a: a["value"].float(), TypeError),
    ("value", lambda a: a["value"][:, :-4], ValueError),
    ("k_buffer", lambda a: a["k_buffer"].float(), TypeError),
    ("k_buffer", lambda a: a["k_buffer"].view(torch.uint8), TypeError),  # raw uint8 storage
    ("k_buffer", lambda a: a["k_buffer"][:, :1], ValueError),  # wrong head count
    ("k_buffer", lambda a: a["k_buffer"].transpose(1, 2), ValueError),  # last dim not contiguous
    ("k_buffer", lambda a: torch.randn(32, HKV + 1, D).bfloat16()[:, 1:], None),  # valid view
    ("v_buffer", lambda a: a["v_buffer"][:16], ValueError),  # slot count != k_buffer
    ("v_buffer", lambda a: a["v_buffer"].view(-1), ValueError),
    ("cache_loc", lambda a: a["cache_loc"][:4], ValueError),
    ("cache_loc", lambda a: a["cache_loc"].float(), TypeError),
    ("k_scale", lambda a: -1.0, ValueError),
    ("k_scale", lambda a: float("nan"), ValueError),
    ("v_scale", lambda a: torch.ones(2), ValueError),
    ("v_scale", lambda a: torch.ones(1, dtype=torch.int32), TypeError),
    ("v_scale", lambda a: "2.0", TypeError),
]


@pytest.mark.parametrize("backend_name", ["native", "triton"])
@pytest.mark.parametrize("row", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_and_touches_nothing(backend, backend_name, row):
    name, make, exc = row[:3]
    named = row[3] if len(row) > 3 else name
    backend(backend_name)
    on_gpu = backend_name == "triton" and torch.cuda.is_available()
    a = make_args("cuda" if on_gpu else "cpu")
    a[name] = make(a)
    if isinstance(a[name], torch.Tensor):
        a[name] = a[name].to(a["query"].device)
    snapshot = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    if exc is None:  # a valid variant: must run
        call(a)
        return
    with pytest.raises(exc) as info:
        call(a)
    assert named in str(info.value), str(info.value)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(bits(v), bits(snapshot[k])), f"{k} was modified"


def test_wrong_device_and_missing_arg_type():
    a = make_args()
    with pytest.raises(TypeError, match="fused_set_kv_buffer_arg"):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            a["positions"], a["query"], a["key"], D, a["cos_sin_cache"], True, (1, 2)
        )
    if torch.cuda.is_available():
        a["k_buffer"] = a["k_buffer"].cuda()
        with pytest.raises(ValueError, match="k_buffer"):
            call(a)


def test_set_kv_buffer_validates():
    a = make_args()
    with pytest.raises(ValueError, match="cache_loc"):
        sgl_ext.set_kv_buffer(
            a["key"], a["value"], a["k_buffer"], a["v_buffer"], a["cache_loc"][:2]
        )
    with pytest.raises(ValueError, match="head_size"):
        sgl_ext.set_kv_buffer(
            a["key"], a["value"], a["k_buffer"].flatten(1), a["v_buffer"].flatten(1), a["cache_loc"]
        )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda a: a.update(cache_loc=torch.tensor([1, 2, 3, 4, 99])), "num_slots"),
        (lambda a: a.update(cache_loc=torch.tensor([1, 2, 3, 2, -1])), "twice"),
        (lambda a: a.update(positions=torch.tensor([0, 1, 20, 3, 4])), "positions"),
    ],
)
def test_debug_checks(change, match):
    a = make_args()
    change(a)
    call(a)  # without debug checks: runs (out-of-range slots are skipped, never written)
    sgl_ext.set_debug_checks(True)
    try:
        a = make_args()
        change(a)
        before = a["k_buffer"].clone()
        with pytest.raises(ValueError, match=match):
            call(a)
        assert torch.equal(a["k_buffer"], before)
    finally:
        sgl_ext.set_debug_checks(None)

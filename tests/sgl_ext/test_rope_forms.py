"""The op's two call forms: sgl_kernel's (#9014) and SGLang 0.5's give the same bits; a call that
mixes them, or an argument missing cache_loc, gets a clear error before any write."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from tests.sgl_ext.sgl_ext_testutil import bits, make_cos_sin_cache, poison

HAS_CUDA = torch.cuda.is_available()
BACKENDS = ["native", "triton"]


@dataclass
class SGLangArg:
    """SGLang 0.5's own four-field argument (sglang.kernels.ops.attention.rope)."""

    value: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    cache_loc: torch.Tensor


def _inputs(seed, t, hq, hkv, d, rot, kv_dtype, device):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hq, d, generator=gen).bfloat16().to(device)
    k = torch.randn(t, hkv, d, generator=gen).bfloat16().to(device)
    v = torch.randn(t, hkv, d, generator=gen).bfloat16().to(device)
    pos = torch.randint(0, 64, (t,), generator=gen).to(device)
    cs = make_cos_sin_cache(64, rot).to(device)
    slots = 2 * t + 3
    loc = torch.randperm(slots, generator=gen)[:t].to(torch.int32)
    loc[0] = -1  # skipped
    kb = poison(torch.empty(slots, hkv * d, dtype=kv_dtype, device=device))  # SGLang's 2-D view
    return q, k, v, pos, cs, loc.to(device), kb, poison(torch.empty_like(kb))


def _device(name):
    return "cuda" if HAS_CUDA and name == "triton" else "cpu"


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    "neox,rot,kv_dtype,scales",
    [
        (True, 16, torch.bfloat16, False),
        (False, 8, torch.bfloat16, False),  # GPT-J, partial rotary (rope_dim 8 of 16)
        (True, 16, torch.float8_e4m3fn, True),
        (False, 8, torch.float8_e5m2, True),
    ],
)
@pytest.mark.parametrize("call", ["keyword", "positional", "sglang_arg"])
def test_same_bits_both_forms(backend, name, neox, rot, kv_dtype, scales, call):
    backend(name)
    dev = _device(name)
    t, hq, hkv, d = 7, 4, 2, 16
    q, k, v, pos, cs, loc, kb, vb = _inputs(3, t, hq, hkv, d, rot, kv_dtype, dev)
    ks, vs = (0.5, torch.tensor([2.0], device=dev)) if scales else (None, None)
    if call == "sglang_arg" and scales:
        pytest.skip("SGLang 0.5's own argument has no scales")
    outs = []
    for form in ("9014", call):
        qq, kk, kb2, vb2 = q.clone(), k.clone(), kb.clone(), vb.clone()
        if form == "9014":
            arg = FusedSetKVBufferArg(v, kb2, vb2, ks, vs, loc)
            sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, qq, kk, d, cs, neox, arg)
        else:
            if form == "sglang_arg":
                arg = SGLangArg(value=v, k_buffer=kb2, v_buffer=vb2, cache_loc=loc)
            else:
                arg = FusedSetKVBufferArg(
                    value=v, k_buffer=kb2, v_buffer=vb2, cache_loc=loc, k_scale=ks, v_scale=vs
                )
            rope_dim = rot if form == "keyword" else 0
            if form == "positional":
                sgl_ext.apply_rope_with_cos_sin_cache_inplace(
                    qq, kk, cs, pos, is_neox=neox, fused_args=arg
                )
            else:
                sgl_ext.apply_rope_with_cos_sin_cache_inplace(
                    q=qq,
                    k=kk,
                    cos_sin_cache=cs,
                    positions=pos,
                    is_neox=neox,
                    rope_dim=rope_dim,
                    fused_args=arg,
                )
        outs.append((qq, kk, kb2, vb2))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(bits(a), bits(b))
    assert not torch.equal(bits(outs[0][0]), bits(q))  # it did rotate


@pytest.mark.parametrize("name", BACKENDS)
def test_rope_only_both_forms(backend, name):
    backend(name)
    dev = _device(name)
    q, k, _, pos, cs, *_ = _inputs(5, 9, 6, 2, 32, 32, torch.bfloat16, dev)
    q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(pos, q1, k1, 32, cs, False)
    sgl_ext.apply_rope_with_cos_sin_cache_inplace(
        q=q2, k=k2, cos_sin_cache=cs, positions=pos, is_neox=False
    )
    assert torch.equal(bits(q1), bits(q2)) and torch.equal(bits(k1), bits(k2))


def test_missing_cache_loc_is_a_clear_error():
    v = torch.randn(2, 8)
    kb = torch.zeros(4, 8)
    with pytest.raises(TypeError, match="cache_loc is required"):
        FusedSetKVBufferArg(value=v, k_buffer=kb, v_buffer=kb.clone())
    loc = torch.tensor([0, 1])
    with pytest.raises(TypeError, match="SGLang 0.5's positional order"):
        FusedSetKVBufferArg(v, kb, kb.clone(), loc)  # SGLang 0.5's order, positionally
    a = FusedSetKVBufferArg(v, kb, kb.clone(), None, None, loc)  # #9014, positionally
    assert a.cache_loc is loc and a.k_scale is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"query": "q"}, "mixed with sgl_kernel's: query"),
        ({"head_size": 16}, "mixed with sgl_kernel's: head_size"),
        ({"fused_set_kv_buffer_arg": "arg"}, "fused_set_kv_buffer_arg"),
    ],
)
def test_mixing_the_forms_is_a_clear_error(kwargs, match):
    q, k, v, pos, cs, loc, kb, vb = _inputs(1, 3, 2, 2, 16, 16, torch.bfloat16, "cpu")
    before = [x.clone() for x in (q, k, kb)]
    subst = {"q": q, "arg": FusedSetKVBufferArg(v, kb, vb, None, None, loc)}
    kwargs = {n: subst.get(x, x) if isinstance(x, str) else x for n, x in kwargs.items()}
    with pytest.raises(TypeError, match=match):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            q=q, k=k, cos_sin_cache=cs, positions=pos, is_neox=True, **kwargs
        )
    with pytest.raises(TypeError, match="cos_sin_cache \\(5th\\)"):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(q, k, cs, pos, cs)
    for a, b in zip((q, k, kb), before, strict=True):
        assert torch.equal(bits(a), bits(b))  # nothing written


def test_bad_values_in_sglang_form():
    q, k, v, pos, cs, loc, kb, vb = _inputs(2, 3, 2, 2, 16, 16, torch.bfloat16, "cpu")
    kw = dict(cos_sin_cache=cs, positions=pos, is_neox=True)
    with pytest.raises(ValueError, match="rope_dim must be 0 or cos_sin_cache's width 16"):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(q=q, k=k, rope_dim=8, **kw)
    with pytest.raises(ValueError, match="q must be a \\[num_tokens, num_heads, head_dim\\]"):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(q=q.flatten(1), k=k, **kw)
    with pytest.raises(TypeError, match="fused_args must be a FusedSetKVBufferArg"):
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(q=q, k=k, fused_args={"value": v}, **kw)

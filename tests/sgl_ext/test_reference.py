"""The ops' torch-native references are made from the ops' signatures (`sgl_ext/_reference.py`):
their signatures, names and binding behave as the hand-written ones did."""

from __future__ import annotations

import inspect

import pytest
import torch

import sgl_ext
from sgl_ext._reference import native_reference

# Each reference's parameters and defaults, as its callers (tests, SGLang-style code) use them.
EXPECTED = {
    "apply_rope_native": (
        "positions query key head_size cos_sin_cache is_neox=True fused_set_kv_buffer_arg=None"
    ),
    "apply_qk_norm_rope_native": (
        "positions query key head_size cos_sin_cache q_norm_weight k_norm_weight eps is_neox=True"
        " fused_set_kv_buffer_arg=None"
    ),
    "qkv_proj_with_rope_kv_native": (
        "x weight bias positions cos_sin_cache head_size num_kv_heads out is_neox=True"
        " fused_set_kv_buffer_arg=None"
    ),
    "set_kv_buffer_native": (
        "key value k_buffer v_buffer cache_loc k_scale=None v_scale=None head_size=None"
    ),
}


def _spelled(fn) -> str:
    out = []
    for p in inspect.signature(fn).parameters.values():
        assert p.kind is p.POSITIONAL_OR_KEYWORD, p
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return " ".join(out)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_signatures(name):
    fn = getattr(sgl_ext, name)
    assert fn.__name__ == name
    assert _spelled(fn) == EXPECTED[name]
    assert "torch-native reference" in fn.__doc__


def test_reference_binds_like_a_def():
    with pytest.raises(TypeError, match="missing a required argument: 'query'"):
        sgl_ext.apply_rope_native(torch.zeros(1, dtype=torch.long))
    with pytest.raises(TypeError, match="enable_pdl"):
        sgl_ext.apply_rope_native(*([None] * 5), enable_pdl=True)
    with pytest.raises(TypeError, match="too many positional"):
        sgl_ext.set_kv_buffer_native(*([None] * 9))


def test_native_reference_keywords_reach_the_body_in_order():
    def op(a: int, b: int | None = None, enable_pdl: bool | None = None, c: int = 3) -> tuple:
        return ()

    seen = []
    ref = native_reference(op, lambda *args: seen.append(args))
    assert list(inspect.signature(ref).parameters) == ["a", "b", "c"]
    ref(1, c=5)
    ref(c=7, a=2, b=4)
    assert seen == [(1, None, 5), (2, 4, 7)]
    assert ref.__name__ == "op_native"


def test_native_reference_requires_placeholder_defaults():
    # A None default the annotation does not admit stands for another call form of the op.
    def op(x: torch.Tensor = None, y: int | None = None, q: object = None) -> None:  # type: ignore[assignment]
        return None

    ref = native_reference(op, lambda *args: None, drop=("q",))
    params = inspect.signature(ref).parameters
    assert params["x"].default is inspect.Parameter.empty
    assert params["y"].default is None


def test_reference_matches_op_on_cpu():
    torch.manual_seed(0)
    t, hq, hkv, d = 5, 3, 1, 16
    pos = torch.randint(0, 11, (t,))
    cs = torch.randn(11, 10)
    q, k, v = torch.randn(t, hq * d), torch.randn(t, hkv * d), torch.randn(t, hkv * d)
    kb, vb = torch.zeros(9, hkv, d), torch.zeros(9, hkv, d)
    loc = torch.tensor([3, -1, 0, 8, 5])
    outs = []
    for fn in (sgl_ext.apply_rope_with_cos_sin_cache_inplace, sgl_ext.apply_rope_native):
        qq, kk, kbb, vbb = q.clone(), k.clone(), kb.clone(), vb.clone()
        arg = sgl_ext.FusedSetKVBufferArg(v, kbb, vbb, None, 2.0, loc)
        fn(pos, qq, kk, d, cs, False, fused_set_kv_buffer_arg=arg)
        outs.append((qq, kk, kbb, vbb))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(outs[0][0], q)  # rotated

"""rope_kv_schema: the kernel family's declared arguments against the kernel, the plans, the C
fast path's leaves and the registered ops."""

from __future__ import annotations

import inspect

import pytest
import torch

from sgl_ext import FusedSetKVBufferArg, rope, rope_kv_schema, settings
from sgl_ext.rope_kv_schema import QK_NORM_OP, ROPE_OP, SET_KV_OP, Role
from sgl_ext.triton import rope_kv_plan as rp
from sgl_ext.triton.rope_kv import rope_kv_kernel


def test_declaration_matches_the_kernel():
    """Every kernel parameter is declared once with its role; the constexprs in the kernel's
    order; the runtime ones are the plan's call names (the kernel keeps its own order)."""
    fn = getattr(rope_kv_kernel, "fn", rope_kv_kernel)  # the JIT's or the interpreter's
    params = inspect.signature(fn).parameters.values()
    constexpr = {p.name: "constexpr" in str(p.annotation) for p in params}
    declared = {a.name: a.role for a in rope_kv_schema.KERNEL_ARGS}
    assert len(declared) == len(rope_kv_schema.KERNEL_ARGS) == len(constexpr)
    for name, is_constexpr in constexpr.items():
        role = declared[name]
        assert (role is Role.CONSTEXPR) == is_constexpr, name
        if role is Role.POINTER:
            assert name.endswith("_ptr")
        if role is Role.STRIDE:
            assert "stride" in name
    runtime = [n for n, c in constexpr.items() if not c]
    assert sorted(runtime) == sorted(rope_kv_schema.CALL_NAMES)
    assert [n for n, c in constexpr.items() if c] == [a.name for a in rope_kv_schema.CONSTEXPRS]


def test_fixed_and_constexprs_check_their_names():
    names = [a.name for a in rope_kv_schema.FIXED]
    values = {n: i for i, n in enumerate(names)}
    assert rope_kv_schema.fixed(**values) == tuple(range(len(names)))
    with pytest.raises(TypeError, match="missing \\['eps'\\]"):
        rope_kv_schema.fixed(**{n: 0 for n in names[:-1]})
    with pytest.raises(TypeError, match="unknown \\['bogus'\\]"):
        rope_kv_schema.fixed(**values, bogus=1)
    with pytest.raises(TypeError, match="constexprs"):
        rope_kv_schema.constexprs(HEAD_DIM=64)


def test_pointer_tensors_stand_in_for_missing_ones():
    key = torch.empty(2, 8)
    v, loc, ks = torch.empty(2, 8), torch.zeros(2, dtype=torch.long), torch.ones(1)
    got = rope_kv_schema.pointer_tensors(key, value=v, cache_loc=loc, k_scale=ks, v_scale=0.5)
    by_name = dict(zip(rope_kv_schema.POINTER_TENSORS, got, strict=True))
    assert by_name["value"] is v and by_name["cache_loc"] is loc and by_name["k_scale"] is ks
    assert by_name["v_scale"] is key and by_name["positions"] is key  # a float scale; absent
    with pytest.raises(TypeError, match="unknown"):
        rope_kv_schema.pointer_tensors(key, values=v)


# The C fast path's pointer leaves and keyed requires_grad leaves as the ops spelled them out
# before the declaration: (op, tensors a call passes, expected leaves).
LEAVES = [
    (ROPE_OP, {"positions", "query", "key", "cos_sin_cache"}, (0, 4, 1, 2, *(2,) * 6, 2, 2)),
    (
        ROPE_OP,
        {"positions", "query", "key", "cos_sin_cache", "value", "k_buffer", "v_buffer"}
        | {"cache_loc", "v_scale"},
        (0, 4, 1, 2, 8, 9, 10, 11, 2, 13, 2, 2),
    ),
    (
        QK_NORM_OP,
        {"positions", "query", "key", "cos_sin_cache", "q_norm_weight", "k_norm_weight"}
        | {"value", "k_buffer", "v_buffer", "cache_loc", "k_scale", "v_scale"},
        (0, 4, 1, 2, 11, 12, 13, 14, 15, 16, 5, 6),
    ),
    (
        SET_KV_OP,
        {"key", "value", "k_buffer", "v_buffer", "cache_loc", "k_scale"},
        (0, 0, 0, 0, 1, 2, 3, 4, 5, 0, 0, 0),
    ),
]


@pytest.mark.parametrize("spec,present,want", LEAVES, ids=lambda x: getattr(x, "name", ""))
def test_fast_path_leaves(spec, present, want):
    assert spec.leaves(present) == want


def test_fast_path_tables():
    assert ROPE_OP.grad() == (1, 2, 9, 10) and ROPE_OP.expand()[0][0] == 7
    assert QK_NORM_OP.grad() == (1, 2, 12, 13) and QK_NORM_OP.expand()[0][0] == 10
    assert SET_KV_OP.grad() == (2, 3) and SET_KV_OP.expand() == ()
    assert ROPE_OP.expand()[0][1] == rope_kv_schema.KV_FIELDS


def test_registered_schemas():
    """The registered ops carry the declared schemas (the ones torch would infer)."""
    import sgl_ext._ops  # noqa: F401

    for spec in (ROPE_OP, QK_NORM_OP, SET_KV_OP):
        schema = str(getattr(torch.ops.sgl_ext, spec.name).default._schema)
        assert schema == f"sgl_ext::{spec.name}{spec.schema}"
    assert ROPE_OP.mutates == ("query", "key", "k_buffer", "v_buffer")


@pytest.mark.parametrize("n", [2, 3, 8, 14])
def test_tuning_string_round_trip(n):
    """The readable string reads back; the positional one's first n fields set, the rest
    default (merged, pre_wait, then its norm weights and slot before the wait)."""
    values = (16, 4, 1, 1, 0, 40, 1, 0, 1, 0, 2, 1, 1, 1)[:n]
    got = rp.parse_tuning(values)
    assert rp.parse_tuning(rp.tuning_string(got)) == got
    assert (got.block_h, got.num_warps) == (16, 4)
    assert got.order.code == (values[2:3] or (1,))[0] and got.maxnreg == (40 if n > 5 else 0)
    assert (got.programs is rp.Programs.MERGED) == (n > 3)
    assert got.load is (
        rp.LoadOrder.PRE_WAIT if n > 11 else rp.LoadOrder.POS_LAST if n > 6 else rp.LoadOrder.START
    )
    assert got.slot_pre == (n > 13) and got.kv_block_h == (2 if n > 10 else 0)


@pytest.mark.parametrize("values", [(4,), tuple(range(15))])
def test_tuning_string_bad_length(values):
    with pytest.raises(ValueError, match="SGL_EXT_TRITON_CONFIG takes 2 to 14"):
        rp.parse_tuning(values)


def test_plan_fixed_arguments_by_name():
    """A plan's fixed tuple holds each declared value where CALL_NAMES says."""
    t, hq, hkv, d = 5, 6, 2, 64
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    kb = torch.empty(8, 16, hkv, d, dtype=torch.float8_e4m3fn)  # [pages, page, H, D]
    arg = FusedSetKVBufferArg(v, kb, torch.empty_like(kb), 0.5, 0.25, torch.zeros(t).long())
    call = rope.check(torch.zeros(t).long(), q, k, d, torch.empty(100, d), True, arg)
    with settings.override(triton_config=None):
        plan = rp.plan_rope_kv(call, 0, 0, 0, False)
    names = rope_kv_schema.CALL_NAMES[len(rope_kv_schema.POINTERS) :]
    fixed = dict(zip(names, plan.fixed, strict=True))
    assert fixed["k_scale_f"] == 2.0 and fixed["v_scale_f"] == 4.0
    assert fixed["q_tok_stride"] == (hq + 2 * hkv) * d and fixed["k_head_stride"] == d
    assert fixed["kb_page_stride"] == 16 * hkv * d and fixed["kb_off_stride"] == hkv * d
    assert fixed["num_slots"] == 8 * 16 and fixed["num_q_heads"] == hq
    assert fixed["max_pos"] == 100 and fixed["eps"] == 0.0
    assert plan.call_names == rope_kv_schema.CALL_NAMES


def test_written_pointers():
    """The alias checks' written tensors, by their index in the kernels' pointer order."""
    names = rope_kv_schema.POINTER_TENSORS
    for spec, written in (
        (ROPE_OP, {"query", "key", "k_buffer", "v_buffer"}),
        (QK_NORM_OP, {"query", "key", "k_buffer", "v_buffer"}),
        (SET_KV_OP, {"k_buffer", "v_buffer"}),
    ):
        assert {names[i] for i in spec.written_pointers()} == written

"""MXFP4 GEMV experts with fp16 products (moe_gemv_f16.py): the activations' fp16 form is exact
and scaled as documented, the outputs stay within the float32 GEMV's error of the float64
reference (bf16 activations, repeated and out-of-range experts, clamped activations),
and the paths it does not serve fall back to the float32 GEMV."""

import dataclasses

import pytest
import torch

from srt.layers.moe.fused_moe_triton.fused_moe import GemmConfig, MoeConfig, fused_experts
from srt.layers.moe.fused_moe_triton.moe_gemv_f16 import f16_products_apply
from srt.layers.moe.fused_moe_triton.moe_x_f16 import XF16, act_f16_shift, pair_order, x_to_f16
from srt.layers.moe.topk import select_experts, select_experts_x_f16
from tests.srt.layers.test_moe_triton import (
    ALPHA,
    DEV,
    LIMIT,
    _ref,
    _rel,
    gpu,
)
from tests.srt.layers.test_moe_triton_mxfp4 import _dequantised, _mxfp4_problem


def _cfg(block_n: int, block_k: int, stages: int, fp16: bool = True) -> MoeConfig:
    g = GemmConfig(block_n, block_k, 1, stages)
    return MoeConfig(16, g, g, gemv=True, fp16_products=fp16)


@pytest.mark.parametrize("K", [32, 288])
def test_x_to_f16_exact_scaled_and_in_pair_order(K):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(6, K, generator=g)
    x[1] *= 2.0**-30
    x[2] *= 2.0**40
    x[3] = 0.0
    x[4] *= 1e-3
    x[4, 7] = 3e4  # one outlier: the small elements go subnormal in fp16
    x[5] *= 2.0**-110  # near bf16's smallest normals
    x = x.bfloat16().to(DEV)
    x16 = torch.full((6, K), float("nan"), dtype=torch.float16, device=DEV)
    inv = torch.full((6,), float("nan"), device=DEV)
    x_to_f16(x, out=XF16(x16, inv))
    scaled = x16.float()[:, pair_order(K).to(DEV)]  # K order
    assert not scaled.isnan().any() and not inv.isnan().any()
    top = scaled.abs().amax(1)
    for row in (0, 1, 2, 4, 5):
        assert 2**14 <= top[row] < 2**15, (row, top[row])
    assert torch.equal(scaled[3], torch.zeros(K, device=DEV))
    assert inv[3] == 2.0**-126  # a zero row: the largest scale
    normal = scaled.abs() >= 2**-14  # fp16 normals: bf16 fits exactly
    back = scaled * inv[:, None]
    assert torch.equal(back[normal], x.float()[normal])
    step = (2.0**-25) * inv[:, None].expand_as(back)  # half an fp16 subnormal step
    assert ((back - x.float()).abs() <= step)[~normal].all()
    assert normal[4].sum() >= 1 and (~normal[4]).sum() >= 1


@pytest.mark.parametrize(
    "T, E, H, inter, k, block_n, block_k, stages, sums",
    [
        (1, 4, 64, 32, 2, 16, 32, 2, True),
        (5, 5, 96, 64, 3, 16, 64, 2, True),  # uneven K blocks (96 = 64 + 32)
        (3, 5, 64, 96, 2, 16, 64, 1, False),  # uneven down K blocks; a program per pair
    ],
)
def test_f16_products_within_float32_paths_error(T, E, H, inter, k, block_n, block_k, stages, sums):
    dtype = torch.bfloat16
    hf, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
        T, E, H, inter, k, T + 3, DEV
    )
    x, b13, b2 = x.to(dtype), b13.to(dtype), b2.to(dtype)
    ids[0, :2] = 1  # a repeated expert
    if T > 1:
        ids[1, 0], ids[-1, -1] = -1, E  # out of range: contribute zero
    kept = wts.clone()
    kept[ids < 0] = 0.0
    kept[ids >= E] = 0.0
    w13, w2 = _dequantised(hf, DEV)
    ref = _ref(x, w13, b13, w2, b2, kept, ids.clamp(0, E - 1))

    def run(fp16: bool) -> torch.Tensor:
        cfg = _cfg(block_n, block_k, stages, fp16)
        return fused_experts(
            x, w13_q, w2_q, wts, ids, b13, b2, swiglu_alpha=ALPHA, swiglu_limit=LIMIT,
            config=cfg, w13_scale=w13_s, w2_scale=w2_s,
        )  # fmt: skip

    out16, out32 = run(True), run(False)
    assert out16.dtype == dtype and out16.shape == (T, H)
    err16, err32 = _rel(out16, ref), _rel(out32, ref)
    assert err16 <= 1.25 * err32 + 2e-4, (err16, err32)
    assert err16 < 1e-2


def test_f16_products_large_activations_clamp_without_overflow():
    """|x| ~ 1e4: gate and up hit the clamps; the fp16 activations stay finite."""
    T, E, H, inter, k = 3, 4, 64, 64, 2
    hf, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(T, E, H, inter, k, 9, DEV)
    x = (x * 1e4).bfloat16()
    b13, b2 = b13.bfloat16(), b2.bfloat16()
    w13, w2 = _dequantised(hf, DEV)
    out = fused_experts(
        x, w13_q, w2_q, wts, ids, b13, b2, swiglu_alpha=1.702, swiglu_limit=7.0,
        config=_cfg(16, 32, 2), w13_scale=w13_s, w2_scale=w2_s,
    )  # fmt: skip
    ref = _ref(x, w13, b13, w2, b2, wts, ids, alpha=1.702, limit=7.0)
    assert out.isfinite().all()
    assert _rel(out, ref) < 1e-2


def test_act_f16_shift_and_which_calls_take_fp16_products():
    assert act_f16_shift("swiglu_oai", 1.702, 7.0) == 9  # |act| <= 8 * 7 = 56
    assert act_f16_shift("swiglu_oai", ALPHA, LIMIT) == 14  # 1.8 * 1 (the bound is >= 1)
    assert act_f16_shift("silu", 1.702, 7.0) is None
    assert act_f16_shift("swiglu_oai", 1.702, float("inf")) is None
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    kw = dict(activation="swiglu_oai", alpha=1.702, limit=7.0)
    cfg = _cfg(8, 64, 1)
    assert f16_products_apply(cfg, x, True, **kw)
    assert not f16_products_apply(cfg, x, False, **kw)  # bf16 experts
    assert not f16_products_apply(cfg, x.float(), True, **kw)  # float32 activations
    assert not f16_products_apply(cfg, x.half(), True, **kw)  # fp16: products would round
    assert not f16_products_apply(cfg, x, True, **dict(kw, activation="silu"))
    assert not f16_products_apply(_cfg(8, 64, 1, fp16=False), x, True, **kw)
    assert not f16_products_apply(dataclasses.replace(cfg, gemv=False), x, True, **kw)


def test_fp16_products_config_default_on():
    assert MoeConfig(16, GemmConfig(8, 64), GemmConfig(8, 64), gemv=True).fp16_products
    assert not dataclasses.replace(_cfg(8, 64, 1), fp16_products=False).fp16_products


@pytest.mark.parametrize("T, E, k, H", [(1, 32, 4, 96), (7, 5, 2, 32)])
def test_select_experts_x_f16_equals_routing_plus_conversion(T, E, k, H):
    """One launch: the same weights and ids as select_experts' kernel, the same words as
    x_to_f16 (outputs poisoned first)."""
    g = torch.Generator().manual_seed(T + E)
    logits = torch.randn(T, E, generator=g).to(DEV)
    x = torch.randn(T, H, generator=g).bfloat16().to(DEV) * 3
    w, ids, xf = select_experts_x_f16(logits, k, x, weights_dtype=torch.bfloat16)
    if DEV == "cuda":
        w_ref, ids_ref = select_experts(logits, k, weights_dtype=torch.bfloat16)
    else:  # select_experts runs torch off CUDA: its kernel directly
        from srt.layers.moe.topk import _topk_softmax_triton

        w_ref, ids_ref = _topk_softmax_triton(logits, k, torch.bfloat16)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    ref = x_to_f16(x, out=XF16(torch.full_like(xf.words, float("nan")), torch.zeros_like(xf.inv)))
    assert torch.equal(xf.words, ref.words) and torch.equal(xf.inv, ref.inv)
    with pytest.raises(ValueError, match="hidden_states"):
        select_experts_x_f16(logits, k, x[:, :31], weights_dtype=torch.bfloat16)


def test_x_f16_of_the_wrong_shape_raises():
    _, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(2, 3, 64, 32, 2, 0)
    x = x.bfloat16()
    bad = XF16(torch.zeros(2, 32, dtype=torch.float16), torch.ones(2))
    with pytest.raises(ValueError, match="x_f16.words"):
        fused_experts(x, w13_q, w2_q, wts, ids, w13_scale=w13_s, w2_scale=w2_s, x_f16=bad)
    bad = XF16(torch.zeros(2, 64, dtype=torch.float16), torch.ones(3))
    with pytest.raises(ValueError, match="x_f16.inv"):
        fused_experts(x, w13_q, w2_q, wts, ids, w13_scale=w13_s, w2_scale=w2_s, x_f16=bad)


@gpu
@pytest.mark.parametrize("T", [1, 2, 3])  # the table's GEMV rows
def test_gpu_routing_made_x_f16_gives_the_same_bits(T):
    """fused_experts with the x_f16 from select_experts_x_f16 == without it (its own prep), bit
    for bit, on the table's configs; and TopKExperts says when it takes one."""
    from srt.layers.moe import TopKExperts

    E, H, inter, k = 8, 288, 160, 4
    _, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, _, _ = _mxfp4_problem(T, E, H, inter, k, T, "cuda")
    x, b13, b2 = x.bfloat16(), b13.bfloat16(), b2.bfloat16()
    logits = torch.randn(T, E, device="cuda")
    wts, ids, xf = select_experts_x_f16(logits, k, x, weights_dtype=torch.bfloat16)
    kw = dict(swiglu_alpha=1.702, swiglu_limit=7.0, w13_scale=w13_s, w2_scale=w2_s)
    own = fused_experts(x, w13_q, w2_q, wts, ids, b13, b2, **kw)
    given = fused_experts(x, w13_q, w2_q, wts, ids, b13, b2, x_f16=xf, **kw)
    assert torch.equal(own, given)
    m = TopKExperts(E, H, inter, quant_method="mxfp4", mxfp4_packed=True, tp_rank=0, tp_size=1)
    assert m.to("cuda").takes_x_f16(x) and not m.takes_x_f16(x.float())
    assert not m.takes_x_f16(torch.zeros(64, H, dtype=torch.bfloat16, device="cuda"))

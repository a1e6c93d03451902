"""Triton routed-expert MoE with MXFP4 expert weights (the gpt-oss checkpoint's format): a
synthetic HF checkpoint against its float64 dequantisation, scale checks, the GPU's own config
rows; on CUDA: every MXFP4 config of the table, both modes, the scale prefetch's bits and CUDA-graph
replay."""

import dataclasses

import pytest
import torch

from srt.layers.moe.fused_moe_triton import config as moe_config
from srt.layers.moe.fused_moe_triton.fused_moe import (
    fused_experts,
    get_config,
)
from tests.srt.layers.test_moe_triton import (
    ALPHA,
    DEV,
    LIMIT,
    _problem,
    _ref,
    _rel,
    gpu,
    graph_replay_equals_eager,
)


def _mxfp4_problem(T, E, H, inter, k, seed, device="cpu", scales=(120, 126)):
    """A synthetic gpt-oss MXFP4 expert checkpoint in the HF layout (gate/up rows interleaved)
    and our layout of it (gate rows, then up rows)."""
    g = torch.Generator().manual_seed(seed)
    u8 = lambda *s, lo=0, hi=256: torch.randint(lo, hi, s, generator=g, dtype=torch.uint8)
    lo, hi = scales
    hf = {
        "gate_up_proj_blocks": u8(E, 2 * inter, H // 32, 16),
        "gate_up_proj_scales": u8(E, 2 * inter, H // 32, lo=lo, hi=hi),
        "down_proj_blocks": u8(E, H, inter // 32, 16),
        "down_proj_scales": u8(E, H, inter // 32, lo=lo, hi=hi),
    }
    split = lambda t: torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)  # g0 u0 g1 u1 .. -> gate | up
    w13_q = split(hf["gate_up_proj_blocks"]).flatten(-2).to(device)  # [E, 2I, H/2]
    w13_s = split(hf["gate_up_proj_scales"]).contiguous().to(device)  # [E, 2I, H/32]
    w2_q = hf["down_proj_blocks"].flatten(-2).to(device)  # [E, H, I/2]
    w2_s = hf["down_proj_scales"].to(device)  # [E, H, I/32]
    x, _, b13, _, b2, wts, ids = _problem(T, E, H, inter, k, device=device, seed=seed)
    return hf, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids


def _dequantised(hf, device):
    """float64 w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] of an HF checkpoint."""
    from srt.layers.mxfp4 import dequantize_mxfp4

    gate_up = dequantize_mxfp4(hf["gate_up_proj_blocks"], hf["gate_up_proj_scales"], torch.float64)
    w13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)  # [E, 2I, H]
    w2 = dequantize_mxfp4(hf["down_proj_blocks"], hf["down_proj_scales"], torch.float64)
    return w13.to(device), w2.to(device)


def _clamped_experts(x, packed, b13, b2, wts, ids, cfg):
    """fused_experts on MXFP4 weights packed as (w13, w13 scales, w2, w2 scales), with the
    clamped SwiGLU (ALPHA, LIMIT) and launch configuration cfg."""
    w13_q, w13_s, w2_q, w2_s = packed
    kw = dict(swiglu_alpha=ALPHA, swiglu_limit=LIMIT, config=cfg, w13_scale=w13_s, w2_scale=w2_s)
    return fused_experts(x, w13_q, w2_q, wts, ids, b13, b2, **kw)


@pytest.mark.parametrize(
    "T, E, H, inter, k, block_k, dtype, mode, scales, prefetch",
    [
        (1, 4, 64, 32, 2, 32, torch.float32, "split", (120, 126), 1),
        (9, 5, 96, 96, 3, 64, torch.float32, "split", (100, 160), 1),  # uneven K, wide scales
        (9, 5, 96, 96, 3, 64, torch.float32, "split", (100, 160), 0),  # scales not prefetched
        (7, 4, 64, 96, 2, 64, torch.bfloat16, "split", (118, 130), 1),
        (7, 4, 64, 96, 2, 64, torch.bfloat16, "dot_scaled", (118, 130), 1),
    ],
)
def test_mxfp4_weights_match_dequantised_reference(
    T, E, H, inter, k, block_k, dtype, mode, scales, prefetch
):
    from srt.layers.moe.fused_moe_triton.fused_moe import GemmConfig, MoeConfig

    hf, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
        T, E, H, inter, k, T, DEV, scales
    )
    x = x.to(dtype)
    w13, w2 = _dequantised(hf, DEV)
    g = GemmConfig(16, block_k, 1, 1, scale_prefetch=prefetch)
    cfg = MoeConfig(16, g, g, mode)
    out = _clamped_experts(x, (w13_q, w13_s, w2_q, w2_s), b13, b2, wts, ids, cfg)
    assert out.dtype == dtype
    ref = _ref(x, w13, b13, w2, b2, wts, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-4 * ref.abs().max(), rtol=1e-5)
    else:
        assert _rel(out, ref) < 1e-2


def test_mxfp4_bad_scales_raise():
    _, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(2, 3, 64, 32, 2, 0)
    with pytest.raises(TypeError, match="w13_scale"):
        fused_experts(x, w13_q, w2_q, wts, ids, w2_scale=w2_s)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_experts(x, w13_q, w2_q, wts, ids, w13_scale=w13_s, w2_scale=w2_s[:, :, :0])
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x[:, :32], w13_q, w2_q, wts, ids, w13_scale=w13_s, w2_scale=w2_s)
    from srt.layers.moe.fused_moe_triton.fused_moe import INTERPRETER_CONFIG

    bad = dataclasses.replace(INTERPRETER_CONFIG, mxfp4_mode="int4")
    with pytest.raises(ValueError, match="mxfp4_mode"):
        fused_experts(x, w13_q, w2_q, wts, ids, config=bad, w13_scale=w13_s, w2_scale=w2_s)
    down = dataclasses.replace(INTERPRETER_CONFIG.down, scale_prefetch=2)
    bad = dataclasses.replace(INTERPRETER_CONFIG, down=down)
    with pytest.raises(ValueError, match="down.scale_prefetch"):
        fused_experts(x, w13_q, w2_q, wts, ids, config=bad, w13_scale=w13_s, w2_scale=w2_s)


@gpu
@pytest.mark.parametrize("mode", ["dot_scaled", "split"])
@pytest.mark.parametrize("T", [1, 7, 64, 700, 2048])  # every MXFP4 config of the table
def test_gpu_mxfp4_bf16_matches_dequantised(T, mode):
    from srt.layers.moe.fused_moe_triton import fused_moe

    E, H, inter, k = 8, 256, 192, 4  # 192: uneven K blocks of 128
    hf, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
        T, E, H, inter, k, T, "cuda"
    )
    x, b13, b2 = x.bfloat16(), b13.bfloat16(), b2.bfloat16()
    w13, w2 = _dequantised(hf, "cuda")
    cfg = dataclasses.replace(get_config(T, x.device, x.dtype, mxfp4=True), mxfp4_mode=mode)
    out = _clamped_experts(x, (w13_q, w13_s, w2_q, w2_s), b13, b2, wts, ids, cfg)
    if mode == "dot_scaled":  # no silent fallback to split
        assert not fused_moe._DOT_SCALED_FAILED, fused_moe._DOT_SCALED_FAILED
    assert out.dtype == torch.bfloat16
    assert _rel(out, _ref(x, w13, b13, w2, b2, wts, ids)) < 1e-2
    # the unquantised kernel on the dequantised bf16 weights agrees within bf16 rounding
    dense = fused_experts(
        x, w13.bfloat16(), w2.bfloat16(), wts, ids, b13, b2, swiglu_alpha=ALPHA, swiglu_limit=LIMIT
    )
    assert _rel(out, dense) < 1e-2


@gpu
@pytest.mark.parametrize("mode", ["dot_scaled", "split"])
@pytest.mark.parametrize("T", [1, 8, 64])  # the decode configs of the table
def test_gpu_mxfp4_scale_prefetch_same_bits(T, mode):
    """Loading the scales a K block ahead changes where they are loaded, not what is summed:
    the same bits with the prefetch on and off, in each GEMM (uneven K blocks: H 288, I 160)."""
    E, H, inter, k = 6, 288, 160, 4
    _, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
        T, E, H, inter, k, 5, "cuda"
    )
    x, b13, b2 = x.bfloat16(), b13.bfloat16(), b2.bfloat16()
    base = dataclasses.replace(get_config(T, x.device, x.dtype, mxfp4=True), mxfp4_mode=mode)
    outs = {}
    for gp, dp in ((1, 1), (0, 0), (1, 0), (0, 1)):
        cfg = dataclasses.replace(
            base,
            gate_up=dataclasses.replace(base.gate_up, scale_prefetch=gp),
            down=dataclasses.replace(base.down, scale_prefetch=dp),
        )
        outs[gp, dp] = fused_experts(
            x, w13_q, w2_q, wts, ids, b13, b2, config=cfg, w13_scale=w13_s, w2_scale=w2_s
        )
    for key, out in outs.items():
        assert torch.equal(out, outs[1, 1]), (T, mode, key)
    assert torch.isfinite(outs[1, 1]).all() and outs[1, 1].abs().sum() > 0


@gpu
def test_gpu_mxfp4_graph_replay_equals_eager():
    T, E, H, inter, k = 8, 8, 256, 128, 4
    _, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
        T, E, H, inter, k, 3, "cuda"
    )
    x, b13, b2 = x.bfloat16(), b13.bfloat16(), b2.bfloat16()
    run = lambda: fused_experts(x, w13_q, w2_q, wts, ids, b13, b2, w13_scale=w13_s, w2_scale=w2_s)
    graph_replay_equals_eager(run, x, wts, ids, E, steps=3, seed=0)


@pytest.mark.parametrize("name", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_mxfp4_device_rows_apply_by_gpu_name(monkeypatch, name):
    """A GPU's own MXFP4 rows (MXFP4_DEVICE_OVERRIDES: moe.json's devices) come before the
    H100's on a GPU whose name holds their key, nowhere else; bf16 experts never take them."""
    from sgl_ext import device_tables

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(device_tables, "_names", {})
    moe_config._rows.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        sub = next(iter(moe_config.MXFP4_DEVICE_OVERRIDES))
        row = moe_config.MXFP4_DEVICE_OVERRIDES[sub][0]
        table_row = next(r.config for r in moe_config.MXFP4_CONFIGS if r.covers(row.first))
        assert row.config != table_row  # an exception, not a copy
        want = row.config if sub in name else table_row
        assert get_config(row.first, cuda, mxfp4=True) == want
        bf16 = next(r.config for r in moe_config.MOE_CONFIGS if r.covers(row.first))
        assert get_config(row.first, cuda) == bf16
    finally:
        moe_config._rows.cache_clear()

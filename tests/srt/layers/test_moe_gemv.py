"""The per-pair routed-expert kernels (moe_gemv.py, `MoeConfig.gemv`): against the float64
reference (bf16/fp32 weights and MXFP4), repeated experts, out-of-range ids, agreement with the
grouped kernels; on CUDA: the table's GEMV configs on uneven K blocks and CUDA-graph replay."""

import dataclasses

import pytest
import torch

from srt.layers.moe.fused_moe_triton.config import moe_table
from srt.layers.moe.fused_moe_triton.fused_moe import (
    GemmConfig,
    MoeConfig,
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
from tests.srt.layers.test_moe_triton_mxfp4 import _dequantised, _mxfp4_problem


def _gemv(
    block_n: int, block_k: int, down_k: int | None = None, warps: int = 1, stages: int = 1
) -> MoeConfig:
    """A GEMV config; stages 2 prefetches each next K block (a second code path)."""
    g = GemmConfig(block_n, block_k, warps, stages)
    return MoeConfig(16, g, dataclasses.replace(g, block_k=down_k or block_k), gemv=True)


def _run(x, w13, w2, wts, ids, b13, b2, cfg, scales=(None, None), **kw):
    return fused_experts(
        x,
        w13,
        w2,
        wts,
        ids,
        b13,
        b2,
        swiglu_alpha=ALPHA,
        swiglu_limit=LIMIT,
        config=cfg,
        w13_scale=scales[0],
        w2_scale=scales[1],
        **kw,
    )


@pytest.mark.parametrize(
    "T, E, H, inter, k, block_n, block_k, stages",
    [(1, 5, 40, 24, 2, 16, 16, 1), (7, 4, 33, 17, 3, 8, 32, 2), (33, 9, 48, 16, 2, 16, 64, 1)],
)
def test_gemv_matches_float64_reference_fp32(T, E, H, inter, k, block_n, block_k, stages):
    """bs 1, odd H / I (masked K and N tails), idle experts."""
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, device=DEV, seed=T + 11)
    out = _run(x, w13, w2, wts, ids, b13, b2, _gemv(block_n, block_k, stages=stages))
    assert out.dtype == torch.float32 and out.shape == (T, H)
    ref = _ref(x, w13, b13, w2, b2, wts, ids)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_gemv_repeated_expert_silu_no_bias_int32_ids_bf16():
    ids = torch.tensor([[2, 2], [0, 2], [2, 0]], dtype=torch.int32)
    x, w13, _, w2, _, wts, ids = _problem(3, 6, 24, 20, 2, torch.bfloat16, DEV, ids=ids)
    out = _run(x, w13, w2, wts.bfloat16(), ids, None, None, _gemv(16, 16), activation="silu")
    assert out.dtype == torch.bfloat16
    ref = _ref(x, w13, None, w2, None, wts.bfloat16(), ids, "silu")
    assert _rel(out, ref) < 1e-2


def test_gemv_out_of_range_expert_ids_contribute_zero():
    """An id < 0 or >= E reads nothing and adds nothing (its pair's rows are zeros)."""
    T, E, H, inter, k = 4, 5, 32, 24, 3
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, device=DEV, seed=2)
    ids[0, 1], ids[2, 0] = -1, E
    out = _run(x, w13, w2, wts, ids, b13, b2, _gemv(16, 32))
    kept = wts.clone()
    kept[0, 1] = kept[2, 0] = 0.0
    ref = _ref(x, w13, b13, w2, b2, kept, ids.clamp(0, E - 1))
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_gemv_agrees_with_grouped_kernels():
    T, E, H, inter, k = 5, 6, 64, 40, 2
    x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, device=DEV, seed=4)
    grouped = _run(x, w13, w2, wts, ids, b13, b2, None)
    torch.testing.assert_close(_run(x, w13, w2, wts, ids, b13, b2, _gemv(16, 32)), grouped)


@pytest.mark.parametrize(
    "T, E, H, inter, k, block_k, dtype, scales, stages",
    [
        (1, 4, 64, 32, 2, 32, torch.float32, (120, 126), 2),
        (9, 5, 96, 96, 3, 64, torch.float32, (100, 160), 2),  # uneven K blocks, wide scales
        (7, 4, 64, 96, 2, 128, torch.bfloat16, (118, 130), 1),  # one K block past I = 96
    ],
)
def test_gemv_mxfp4_matches_dequantised_reference(
    T, E, H, inter, k, block_k, dtype, scales, stages
):
    hf, (w13_q, w13_s, w2_q, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
        T, E, H, inter, k, T, DEV, scales
    )
    x = x.to(dtype)
    w13, w2 = _dequantised(hf, DEV)
    cfg = _gemv(16, block_k, stages=stages)
    out = _run(x, w13_q, w2_q, wts, ids, b13, b2, cfg, scales=(w13_s, w2_s))
    assert out.dtype == dtype
    ref = _ref(x, w13, b13, w2, b2, wts, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-4 * ref.abs().max(), rtol=1e-5)
    else:
        assert _rel(out, ref) < 1e-2


# ----------------------------------------------------------------------------- CUDA


def _table_gemv_configs() -> list[tuple[str, int, MoeConfig]]:
    """(format, T bound, config) of every GEMV row of the tables (plus one default GEMV config,
    so the CUDA tests run before the tables hold one)."""
    table = moe_table()
    every = table.rows + tuple(r for own in table.devices.values() for r in own)
    rows = [(r.experts, r.last or r.first, r.config) for r in every if r.config.gemv]
    default = MoeConfig(16, GemmConfig(16, 256, 4, 1), GemmConfig(16, 256, 4, 1), gemv=True)
    prefetch = MoeConfig(16, GemmConfig(8, 256, 1, 2), GemmConfig(16, 512, 2, 2), gemv=True)
    return rows + [(f, 1, c) for c in (prefetch, default) for f in ("bf16", "mxfp4")]


@gpu
@pytest.mark.parametrize("fmt, T, cfg", _table_gemv_configs())
def test_gpu_gemv_configs_match_reference_and_grouped(fmt, T, cfg):
    E, H, inter, k = 8, 288, 160, 4  # K 288 / 160: uneven K blocks of 256
    if fmt == "mxfp4":
        hf, (w13, w13_s, w2, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
            T, E, H, inter, k, T, "cuda"
        )
        w13_f, w2_f = _dequantised(hf, "cuda")
        scales = (w13_s, w2_s)
    else:
        x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, torch.bfloat16, "cuda", T)
        w13_f, w2_f, scales = w13, w2, (None, None)
    x, b13, b2 = x.bfloat16(), b13.bfloat16(), b2.bfloat16()
    ids[0, :2] = 3  # a repeated expert
    out = _run(x, w13, w2, wts, ids, b13, b2, cfg, scales)
    assert _rel(out, _ref(x, w13_f, b13, w2_f, b2, wts, ids)) < 1e-2
    grouped = get_config(T, x.device, x.dtype, fmt == "mxfp4")
    grouped = dataclasses.replace(grouped, gemv=False)
    assert _rel(out, _run(x, w13, w2, wts, ids, b13, b2, grouped, scales)) < 1e-2


@gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_gpu_gemv_graph_replay_with_new_routings(fmt):
    T, E, H, inter, k = 2, 16, 256, 128, 4
    if fmt == "mxfp4":
        _, (w13, w13_s, w2, w2_s), x, b13, b2, wts, ids = _mxfp4_problem(
            T, E, H, inter, k, 3, "cuda"
        )
        scales = (w13_s, w2_s)
    else:
        x, w13, b13, w2, b2, wts, ids = _problem(T, E, H, inter, k, torch.bfloat16, "cuda", 3)
        scales = (None, None)
    x, b13, b2 = x.bfloat16(), b13.bfloat16(), b2.bfloat16()
    cfg = _table_gemv_configs()[-1][2]

    def run():
        return _run(x, w13, w2, wts, ids, b13, b2, cfg, scales)

    graph_replay_equals_eager(run, x, wts, ids, E, steps=3, seed=1)

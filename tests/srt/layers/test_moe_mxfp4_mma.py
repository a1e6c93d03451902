"""The "mma" MXFP4 expert kernels (mxfp4_mma.py): the dequantisation alone, then per pair and
grouped against the float64 reference (uneven K blocks, repeated and idle experts, scales up to
the bound), out-of-range ids, the argument checks, the layer's scale bound; on CUDA the table's
and the sweep's configs (inline PTX, tensor cores), subnormal weights and CUDA-graph replay."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from srt.layers.moe import TopKExperts
from srt.layers.moe.fused_moe_triton import mxfp4_mma
from srt.layers.moe.fused_moe_triton.fused_moe import (
    MXFP4_MMA_CONFIGS,
    GemmConfig,
    MoeConfig,
    fused_experts,
    get_config,
)
from srt.layers.mxfp4 import dequantize_mxfp4
from tests.srt.layers.test_moe_triton import (
    ALPHA,
    DEV,
    LIMIT,
    _dequantised,
    _mxfp4_problem,
    _ref,
    _rel,
    gpu,
    graph_replay_equals_eager,
)

ON_GPU = DEV == "cuda"


def _mma(
    block_n: int, block_k: int, per_pair: bool, warps: int = 1, down_k=None, stages: int = 1
) -> MoeConfig:
    """stages 2 prefetches each next K block (a second code path)."""
    g = GemmConfig(block_n, block_k, warps, stages)
    d = dataclasses.replace(g, block_k=down_k or block_k)
    return MoeConfig(16, g, d, "mma", gemv=per_pair)


def _run(x, q, b13, b2, wts, ids, cfg, max_scale=mxfp4_mma.MAX_SCALE, **kw):
    w13, w13_s, w2, w2_s = q
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
        w13_scale=w13_s,
        w2_scale=w2_s,
        mxfp4_max_scale=max_scale,
        **kw,
    )


def _bf16_problem(T, E, H, inter, k, seed, scales=(118, 124), device=DEV):
    hf, q, x, b13, b2, wts, ids = _mxfp4_problem(T, E, H, inter, k, seed, device, scales)
    return hf, q, x.bfloat16(), b13.bfloat16(), b2.bfloat16(), wts.bfloat16(), ids


@triton.jit
def _dequant_kernel(
    w_ptr, s_ptr, out_ptr, kp_ptr, BN: tl.constexpr, BK: tl.constexpr, ASM: tl.constexpr
):
    """One [BN, BK] tile of packed rows (BK / 2 bytes each) dequantised, in logical K order."""
    CC: tl.constexpr = BK // 32
    widx = (CC * tl.arange(0, 4))[:, None] + tl.arange(0, CC)[None, :]
    n = tl.arange(0, BN)
    w = tl.load(w_ptr.to(tl.pointer_type(tl.uint32)) + n[:, None, None] * (BK // 8) + widx[None])
    s = tl.load(s_ptr + n[:, None, None] * (BK // 32) + (widx // 4)[None])
    t = mxfp4_mma._dequant(w, s, BN, BK, ASM)
    kk = tl.arange(0, BK)
    tl.store(out_ptr + n[:, None] * BK + kk[None, :], t.to(tl.float32))
    tl.store(kp_ptr + kk, mxfp4_mma._kperm(BK))


@pytest.mark.parametrize("asm", [False, True] if ON_GPU else [False])
@pytest.mark.parametrize("block_k", [32, 128])
def test_dequant_tile_is_exact_in_its_k_order(block_k, asm):
    """Every E2M1 code and sign, scales 2**-127 .. 2**1 (the bound; subnormal bf16 weights at
    the low end): the tile equals the reference dequantisation at the physical K of each
    logical k, and that map is a permutation. asm: the inline PTX (GPU); else the integer
    path (where PTX cannot run)."""
    BN = 16
    g = torch.Generator().manual_seed(block_k)
    w = torch.randint(0, 256, (BN, block_k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(0, mxfp4_mma.MAX_SCALE + 1, (BN, block_k // 32), generator=g).to(torch.uint8)
    s[0, 0], s[1, 0] = 0, mxfp4_mma.MAX_SCALE
    out = torch.full((BN, block_k), float("nan"), device=DEV)
    kp = torch.full((block_k,), -1, dtype=torch.int32, device=DEV)
    _dequant_kernel[(1,)](w.to(DEV), s.to(DEV), out, kp, BN, block_k, asm)
    assert sorted(kp.tolist()) == list(range(block_k))
    ref = dequantize_mxfp4(w.view(BN, block_k // 32, 16), s, torch.float32)
    assert torch.equal(out.cpu(), ref[:, kp.long().cpu()])


@pytest.mark.parametrize(
    "T, E, H, inter, k, per_pair, block_n, block_k, down_k, stages",
    [
        (1, 4, 64, 32, 2, True, 16, 32, None, 1),
        (3, 5, 96, 64, 3, True, 32, 64, 32, 2),  # K 96 = one block + a tail; prefetch
        (7, 5, 160, 96, 2, False, 16, 128, 64, 1),  # tails in both GEMMs
        (9, 4, 128, 64, 3, False, 16, 32, None, 2),  # prefetch over several blocks
        (2, 4, 64, 32, 2, True, 16, 128, 64, 2),  # K < BLOCK_K: no prefetch, the tail alone
    ],
)
def test_mma_matches_dequantised_reference(
    T, E, H, inter, k, per_pair, block_n, block_k, down_k, stages
):
    hf, q, x, b13, b2, wts, ids = _bf16_problem(T, E, H, inter, k, seed=T)
    ids[0, :2] = 1  # a repeated expert; with E > T * k / 2 some stay idle
    cfg = _mma(block_n, block_k, per_pair, down_k=down_k, stages=stages)
    out = _run(x, q, b13, b2, wts, ids, cfg)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    w13, w2 = _dequantised(hf, DEV)
    assert _rel(out, _ref(x, w13, b13, w2, b2, wts, ids)) < 1e-2


def test_mma_scales_at_the_bound_and_silu_without_bias():
    """Scales 120..128 (the largest whose factor is a bf16), silu, no biases."""
    hf, q, x, _, _, wts, ids = _bf16_problem(2, 3, 64, 64, 2, seed=5, scales=(120, 129))
    q[1][0, 0, 0] = mxfp4_mma.MAX_SCALE
    hf["gate_up_proj_scales"][0, 0, 0] = mxfp4_mma.MAX_SCALE  # the same entry (row 0 is g0)
    out = _run(x, q, None, None, wts, ids, _mma(16, 32, False), activation="silu")
    w13, w2 = _dequantised(hf, DEV)
    assert _rel(out, _ref(x, w13, None, w2, None, wts, ids, "silu")) < 1e-2


def test_mma_per_pair_out_of_range_expert_ids_contribute_zero():
    hf, q, x, b13, b2, wts, ids = _bf16_problem(3, 4, 64, 32, 2, seed=7)
    ids[0, 1], ids[2, 0] = -1, 4
    out = _run(x, q, b13, b2, wts, ids, _mma(16, 32, True))
    kept = wts.clone()
    kept[0, 1] = kept[2, 0] = 0.0
    w13, w2 = _dequantised(hf, DEV)
    assert _rel(out, _ref(x, w13, b13, w2, b2, kept, ids.clamp(0, 3))) < 1e-2


@pytest.mark.parametrize(
    "dtype, max_scale", [(torch.float32, 120), (torch.bfloat16, None), (torch.bfloat16, 129)]
)
def test_mma_mode_needs_bf16_and_known_small_scales(dtype, max_scale):
    _, q, x, b13, b2, wts, ids = _bf16_problem(1, 4, 64, 32, 2, seed=1)
    with pytest.raises(ValueError, match="mxfp4_max_scale"):
        _run(x.to(dtype), q, b13, b2, wts, ids, _mma(16, 32, True), max_scale=max_scale)


def test_default_config_takes_mma_only_when_allowed():
    cuda = torch.device("cuda")
    for bound, cfg in MXFP4_MMA_CONFIGS:
        assert cfg.mxfp4_mode == "mma" and cfg.gate_up.block_k % 32 == 0
        assert get_config(bound, cuda, torch.bfloat16, mxfp4=True, mma=True) == cfg
        assert get_config(bound, cuda, torch.bfloat16, mxfp4=True).mxfp4_mode != "mma"
    big = MXFP4_MMA_CONFIGS[-1][0] + 1
    assert get_config(big, cuda, torch.bfloat16, mxfp4=True, mma=True).mxfp4_mode != "mma"


def test_layer_records_the_largest_scale():
    m = TopKExperts(4, 64, 64, tp_rank=0, tp_size=1, quant_method="mxfp4", mxfp4_packed=True)
    assert m.mxfp4_max_scale is None  # unknown until the weights are in
    with torch.no_grad():
        m.w13_weight_scale.fill_(120)
        m.w2_weight_scale.fill_(119)
        m.w2_weight_scale[3, 5, 1] = 131
    m.process_weights_after_loading()
    assert m.mxfp4_max_scale == 131


# ----------------------------------------------------------------------------- CUDA


def _gpu_configs() -> list[MoeConfig]:
    """The table's rows and a spread of the sweep's tile shapes (both addressings)."""
    rows = [c for _, c in MXFP4_MMA_CONFIGS]
    for bn, bk, w, st in ((64, 128, 4, 1), (128, 256, 8, 1), (64, 128, 4, 2), (128, 64, 4, 2)):
        g = GemmConfig(bn, bk, w, st)
        rows += [MoeConfig(16, g, g, "mma", gemv=pp) for pp in (True, False)]
    return rows


@gpu
@pytest.mark.parametrize("cfg", _gpu_configs())
@pytest.mark.parametrize("T", [1, 5])
def test_gpu_mma_configs_match_reference_and_table_kernels(cfg, T):
    E, H, inter, k = 8, 288, 160, 4  # K 288 / 160: tails after whole K blocks
    hf, q, x, b13, b2, wts, ids = _bf16_problem(T, E, H, inter, k, seed=T, device="cuda")
    ids[0, :2] = 3
    out = _run(x, q, b13, b2, wts, ids, cfg)
    w13, w2 = _dequantised(hf, "cuda")
    assert _rel(out, _ref(x, w13, b13, w2, b2, wts, ids)) < 1e-2
    old = get_config(T, x.device, x.dtype, mxfp4=True)
    assert _rel(out, _run(x, q, b13, b2, wts, ids, old)) < 1e-2


@gpu
@pytest.mark.parametrize("per_pair", [True, False])
def test_gpu_mma_subnormal_weights(per_pair):
    """gate/up scales 0..6: bf16 weights down to subnormal (2**-128), which the MMA must keep;
    x * 2**120 brings the products back to O(1)."""
    hf, q, x, _, _, wts, ids = _bf16_problem(3, 4, 64, 64, 2, seed=9, device="cuda")
    s = torch.randint(0, 7, hf["gate_up_proj_scales"].shape, dtype=torch.uint8)
    hf["gate_up_proj_scales"] = s
    q = (q[0], torch.cat([s[:, 0::2], s[:, 1::2]], dim=1).contiguous().cuda(), q[2], q[3])
    x = (x.float() * 2.0**120).bfloat16()
    out = _run(x, q, None, None, wts, ids, _mma(64, 64, per_pair, warps=4), max_scale=124)
    w13, w2 = _dequantised(hf, "cuda")
    assert _rel(out, _ref(x, w13, None, w2, None, wts, ids)) < 1e-2


@gpu
@pytest.mark.parametrize("per_pair, T", [(True, 2), (False, 8)])
def test_gpu_mma_graph_replay_with_new_routings(per_pair, T):
    E, H, inter, k = 16, 256, 128, 4
    _, q, x, b13, b2, wts, ids = _bf16_problem(T, E, H, inter, k, seed=3, device="cuda")
    cfg = _mma(64, 128, per_pair, warps=4)

    def run():
        return _run(x, q, b13, b2, wts, ids, cfg)

    graph_replay_equals_eager(run, x, wts, ids, E, steps=3, seed=1)

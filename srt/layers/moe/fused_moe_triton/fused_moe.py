"""`fused_experts`: routed experts on Triton (align, gate/up GEMM + activation, down GEMM + bias
+ routing weight, top-k sum), and the launch configurations by token count.

Static shapes throughout (buffers sized from T, k, E and the block size only), no host sync: the
call can be captured in a CUDA graph and replayed with other routings.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import triton
from triton.runtime.errors import OutOfResources

from srt.layers.moe.fused_moe_triton.config import (  # noqa: F401 (re-exported)
    INTERPRETER_CONFIG,
    MXFP4_MODES,
    SHARED_MEMORY_BUDGET,
    GemmConfig,
    MoeConfig,
    fit_mxfp4,
    get_config,
)
from srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels import (
    moe_down_kernel,
    moe_gate_up_kernel,
)
from srt.layers.moe.fused_moe_triton.moe_align_block_size import moe_align_block_size
from srt.layers.moe.fused_moe_triton.moe_gemv import ExpertWeightArgs, run_gemv
from srt.layers.moe.fused_moe_triton.moe_gemv_f16 import f16_products_apply, run_gemv_f16
from srt.layers.moe.fused_moe_triton.moe_sum import moe_sum
from srt.layers.moe.fused_moe_triton.moe_x_f16 import XF16
from srt.layers.moe.topk_pairs import TopKPairs

logger = logging.getLogger(__name__)


def _dot_precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # fp32 stays fp32 (no TF32)


def fused_experts(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "swiglu_oai",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    config: MoeConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    x_f16: XF16 | None = None,
    combine: bool = True,
) -> torch.Tensor | TopKPairs:
    """Each token's top-k experts, weighted and summed, reading only the routed experts.

    Parameters
    ----------
    hidden_states : [T, H] (bf16/fp16/fp32), rows contiguous.
    w13 : [E, 2I, H], same dtype; gate rows 0..I-1, then up rows.
    w2 : [E, H, I], same dtype.
    topk_weights : float [T, k]; routing weights (applied after the down bias).
    topk_ids : int32/int64 [T, k]; expert ids in [0, E).
    w13_bias : [E, 2I] or None; w2_bias : [E, H] or None (pass None on TP ranks > 0).
    activation : "swiglu_oai" (gate = min(gate, limit), up = clamp(up, +-limit),
        (up + 1) * gate * sigmoid(alpha * gate)) or "silu" (silu(gate) * up).
    config : launch configuration (default: get_config(T, device, dtype, MXFP4 or not));
        config.gemv selects the per-pair kernels of moe_gemv.py (decode).
    w13_scale, w2_scale : MXFP4 weights only: w13 is then uint8 [E, 2I, H/2] and w2 uint8
        [E, H, I/2] (E2M1 pairs along the input dim, low nibble first) and these are their uint8
        E8M0 scales [E, 2I, H/32] and [E, H, I/32]; dequantised inside the kernels, in
        config.mxfp4_mode ("dot_scaled" for bf16/fp16 activations, else "split"; should the
        scaled-dot kernels fail to compile, a warning is logged and "split" is used).
    x_f16 : hidden_states' fp16 words (moe_x_f16.XF16, made with the routing by
        `select_experts_x_f16`); used when the fp16-product GEMVs run, else ignored.
    combine : False returns the weighted pair rows as TopKPairs ([T * k, H]) for the caller's
        next RMSNorm to add up (`sgl_ext.moe_sum_add_rmsnorm`), skipping moe_sum's launch.

    Returns
    -------
    [T, H], hidden_states.dtype (TopKPairs with combine=False, T > 0).
    """
    mxfp4 = w13.dtype == torch.uint8
    _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    if mxfp4:
        _check_mxfp4(hidden_states, w13, w13_scale, w2, w2_scale)
    if x_f16 is not None:
        w, inv = x_f16.words, x_f16.inv
        if w.shape != hidden_states.shape or w.dtype != torch.float16 or not w.is_contiguous():
            raise ValueError(f"x_f16.words must be fp16 {tuple(hidden_states.shape)}, contiguous")
        if inv.shape != hidden_states.shape[:1] or inv.dtype != torch.float32:
            raise ValueError(f"x_f16.inv must be float32 [{hidden_states.shape[0]}]")
    dtype, dev = hidden_states.dtype, hidden_states.device
    T = hidden_states.shape[0]
    cfg = config or get_config(T, dev, dtype, mxfp4)
    if cfg.mxfp4_mode not in MXFP4_MODES:
        raise ValueError(f"config.mxfp4_mode must be one of {MXFP4_MODES}, got {cfg.mxfp4_mode!r}")
    for name, g in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        if g.scale_prefetch not in (0, 1):
            raise ValueError(f"config.{name}.scale_prefetch must be 0 or 1, got {g.scale_prefetch}")
    if T == 0:
        return torch.zeros_like(hidden_states)
    kw = dict(activation=activation, alpha=float(swiglu_alpha), limit=float(swiglu_limit))
    if cfg.gemv:  # a pair per program, no alignment (decode)
        cfg = fit_mxfp4(cfg) if mxfp4 else cfg
        alpha, limit = float(swiglu_alpha), float(swiglu_limit)
        gemv_args = (
            hidden_states,
            w13,
            w2,
            topk_weights,
            topk_ids,
            w13_bias,
            w2_bias,
            w13_scale,
            w2_scale,
            cfg,
            activation,
            alpha,
            limit,
        )
        if f16_products_apply(cfg, hidden_states, mxfp4, activation, alpha, limit):
            pairs = run_gemv_f16(*gemv_args, x_f16)  # fp16 products: fewer instructions a byte
        else:
            pairs = run_gemv(*gemv_args)
        return _combine(pairs, T, topk_ids.shape[1], combine)
    pairs = _run_grouped(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        w13_bias,
        w2_bias,
        w13_scale,
        w2_scale,
        cfg,
        mxfp4,
        kw,
    )
    return _combine(pairs, T, topk_ids.shape[1], combine)


def _run_grouped(
    hidden_states,
    w13,
    w2,
    topk_weights,
    topk_ids,
    w13_bias,
    w2_bias,
    w13_scale,
    w2_scale,
    cfg,
    mxfp4,
    kw,
) -> torch.Tensor:
    """The grouped kernels (tokens aligned per expert) -> [T * k, H] pair rows: MXFP4's
    dot_scaled mode falling back to split, shallower pipelines where shared memory runs out."""
    dtype = hidden_states.dtype
    mode = 0
    if mxfp4:
        cfg = fit_mxfp4(cfg)  # whole scale groups per K block
        scaled = cfg.mxfp4_mode == "dot_scaled" and dtype in (torch.bfloat16, torch.float16)
        mode = 2 if scaled and (cfg, dtype) not in _DOT_SCALED_FAILED else 1
    align = moe_align_block_size(topk_ids, w13.shape[0], cfg.block_m)
    args = (hidden_states, w13, w2, topk_weights, w13_bias, w2_bias, w13_scale, w2_scale)
    if mode == 2:
        try:
            return _run_gemms(*args, align, cfg, 2, **kw)
        except Exception as e:  # no working scaled dot for this config here: split from now on
            _DOT_SCALED_FAILED[(cfg, dtype)] = f"{type(e).__name__}: {str(e)[:300]}"
            logger.warning("MXFP4 dot_scaled kernels failed for %s (%s); using 'split'", cfg, e)
            mode = 1
    try:
        return _run_gemms(*args, align, cfg, mode, **kw)
    except OutOfResources as e:  # shared memory of this GPU: shallower pipelines
        small = replace(
            cfg,
            gate_up=replace(cfg.gate_up, num_stages=2),
            down=replace(cfg.down, num_stages=2),
        )
        if small == cfg:
            raise
        logger.warning("MoE kernels out of resources with %s (%s); retrying 2 stages", cfg, e)
        return _run_gemms(*args, align, small, mode, **kw)


# (config, dtype) -> error, of the dot_scaled MXFP4 kernels in this process (these take "split").
_DOT_SCALED_FAILED: dict[tuple[MoeConfig, torch.dtype], str] = {}


def _run_gemms(
    x, w13, w2, topk_weights, w13_bias, w2_bias, w13_scale, w2_scale, align, cfg, mode, **kw
) -> torch.Tensor:
    """The two grouped GEMMs on the alignment -> [T * k, H] pair rows; mode 0 (unquantised
    weights), 1 (MXFP4 split) or 2 (MXFP4 dot_scaled)."""
    T, H = x.shape
    inter = w13.shape[1] // 2
    k = align.num_pairs // T
    a13 = ExpertWeightArgs.of(w13, w13_scale if mode else None, w13_bias)
    a2 = ExpertWeightArgs.of(w2, w2_scale if mode else None, w2_bias)
    dtype, dev = x.dtype, x.device
    rows = align.max_blocks * cfg.block_m
    act = torch.empty(rows, inter, dtype=dtype, device=dev)  # [padded rows, I]
    prec = _dot_precision(dtype)
    upcast = dev.type != "cuda"  # interpreter: fp32 dot (its bf16 dot is wrong)
    a_format = "fp16" if dtype == torch.float16 else "bf16"
    g = cfg.gate_up
    grid = (align.max_blocks * triton.cdiv(inter, g.block_n),)
    moe_gate_up_kernel[grid](
        x,
        *a13.ptrs,
        act,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        inter,
        H,
        align.max_blocks,
        x.stride(0),
        *a13.strides,
        act.stride(0),
        kw["alpha"],
        kw["limit"],
        TOP_K=k,
        ACTIVATION=kw["activation"],
        HAS_BIAS=w13_bias is not None,
        DOT_PRECISION=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=g.block_n,
        BLOCK_K=g.block_k,
        GROUP_M=g.group_m,
        EVEN_K=H % g.block_k == 0,
        UPCAST=upcast,
        MXFP4=mode,
        A_FORMAT=a_format,
        SCALE_PREFETCH=g.scale_prefetch if mode else 0,
        num_warps=g.num_warps,
        num_stages=g.num_stages,
    )
    out = torch.empty(T * k, H, dtype=dtype, device=dev)  # [T*k, H], pair order
    d = cfg.down
    grid = (align.max_blocks * triton.cdiv(H, d.block_n),)
    moe_down_kernel[grid](
        act,
        *a2.ptrs,
        topk_weights.contiguous(),
        out,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        H,
        inter,
        align.max_blocks,
        act.stride(0),
        *a2.strides,
        out.stride(0),
        HAS_BIAS=w2_bias is not None,
        DOT_PRECISION=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=d.block_n,
        BLOCK_K=d.block_k,
        GROUP_M=d.group_m,
        EVEN_K=inter % d.block_k == 0,
        UPCAST=upcast,
        MXFP4=mode,
        A_FORMAT=a_format,
        SCALE_PREFETCH=d.scale_prefetch if mode else 0,
        num_warps=d.num_warps,
        num_stages=d.num_stages,
    )
    return out  # [T * k, H] pair rows (pair order)


def _combine(pairs: torch.Tensor, T: int, k: int, combine: bool) -> torch.Tensor | TopKPairs:
    """[T * k, H] pair rows -> [T, H] (moe_sum), or TopKPairs for the caller to combine."""
    return moe_sum(pairs, T, k) if combine else TopKPairs(pairs, k)


def _check_mxfp4(x, w13, w13_scale, w2, w2_scale) -> None:
    """MXFP4 weights: uint8 values [E, N, K/2] with uint8 scales [E, N, K/32] (K % 32 == 0)."""
    for name, w, sc in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if w.dtype != torch.uint8 or sc is None or sc.dtype != torch.uint8:
            raise TypeError(f"MXFP4 {name} and {name}_scale must both be uint8 (scale given)")
        if (
            sc.dim() != 3
            or tuple(sc.shape[:2]) != tuple(w.shape[:2])
            or w.shape[2] != 16 * sc.shape[2]
        ):
            raise ValueError(
                f"MXFP4 {name} {tuple(w.shape)} needs {name}_scale [E, N, K/32], "
                f"got {tuple(sc.shape)}"
            )
        if not sc.is_contiguous():
            raise ValueError(f"{name}_scale must be contiguous")


def _check(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation) -> None:
    """Metadata-only argument checks (no device sync), before any launch; MXFP4 weights (uint8)
    are checked in their logical (dequantised) shapes."""
    if activation not in ("swiglu_oai", "silu"):
        raise ValueError(f"activation must be 'swiglu_oai' or 'silu', got {activation!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"hidden_states must be [T, H] with contiguous rows, got {tuple(x.shape)}")
    T, H = x.shape
    pack = 2 if w13.dtype == torch.uint8 else 1  # MXFP4: two values per byte along K
    if w13.dim() != 3 or w13.shape[2] * pack != H or w13.shape[1] % 2 or not w13.is_contiguous():
        raise ValueError(f"w13 must be contiguous [E, 2I, H={H}], got {tuple(w13.shape)}")
    E, inter = w13.shape[0], w13.shape[1] // 2
    if w2.dim() != 3 or (w2.shape[0], w2.shape[1], w2.shape[2] * pack) != (E, H, inter):
        raise ValueError(f"w2 must be contiguous [E={E}, H={H}, I={inter}], got {tuple(w2.shape)}")
    if not w2.is_contiguous():
        raise ValueError("w2 must be contiguous")
    if pack == 1 and (w13.dtype != x.dtype or w2.dtype != x.dtype):
        raise TypeError(f"w13/w2 dtype {w13.dtype}/{w2.dtype} != hidden_states dtype {x.dtype}")
    if pack == 2 and w2.dtype != torch.uint8:
        raise TypeError(f"w13 is MXFP4 (uint8) but w2 is {w2.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.dim() != 2:
        raise TypeError(f"topk_ids must be int32/int64 [T, k], got {topk_ids.dtype}")
    if topk_ids.shape[0] != T or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)} "
            f"must both be [T={T}, k]"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    for name, b, shape in (("w13_bias", w13_bias, (E, 2 * inter)), ("w2_bias", w2_bias, (E, H))):
        if b is not None and (tuple(b.shape) != shape or b.stride(-1) != 1):
            raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}], got {tuple(b.shape)}")
    devs = {
        t.device for t in (x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias) if t is not None
    }
    if len(devs) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")

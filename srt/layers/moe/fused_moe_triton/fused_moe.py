"""`fused_experts`: routed experts on Triton (align, gate/up GEMM + activation, down GEMM + bias
+ routing weight, top-k sum), and the launch configurations by token count.

Static shapes throughout (buffers sized from T, k, E and the block size only), no host sync: the
call can be captured in a CUDA graph and replayed with other routings.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from srt.layers.moe.fused_moe_triton.fused_moe_triton_kernels import (
    moe_down_kernel,
    moe_gate_up_kernel,
)
from srt.layers.moe.fused_moe_triton.moe_align_block_size import moe_align_block_size


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's launch configuration."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1


@dataclass(frozen=True)
class MoeConfig:
    """Both GEMMs' configurations; block_m is shared (the alignment's block size)."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig


# Upper bound on T -> config, measured on the H100 (bf16 activations and experts, gpt-oss-20b
# shape, CUDA graph; benchmarks/bench_moe.py --sweep). Decode (few pairs per expert) is weight-read
# bound: BLOCK_M 16, narrow N tiles so enough programs stream weights, long K blocks; prefill
# grows BLOCK_M and the N tiles. Configurations whose tiles do not fit in shared memory for
# wider dtypes (fp32) are shrunk by `_fit_shared_memory`.
MOE_CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (1, MoeConfig(16, GemmConfig(32, 64, 4, 5, 1), GemmConfig(32, 256, 4, 3, 1))),  # 85.3 µs
    (8, MoeConfig(16, GemmConfig(32, 256, 4, 3, 1), GemmConfig(64, 128, 4, 4, 1))),  # 325.0 µs
    (32, MoeConfig(16, GemmConfig(32, 256, 4, 3, 1), GemmConfig(64, 256, 4, 3, 1))),  # 535.7 µs
    (64, MoeConfig(16, GemmConfig(32, 256, 4, 3, 1), GemmConfig(64, 256, 4, 3, 1))),  # 551.8 µs
    (512, MoeConfig(64, GemmConfig(64, 64, 4, 4, 8), GemmConfig(128, 64, 4, 4, 8))),  # 664.0 µs
    (1 << 62, MoeConfig(128, GemmConfig(128, 64, 8, 3, 8), GemmConfig(256, 64, 8, 3, 8))),  # 2060
)
# Shared memory the pipelined operand tiles of one GEMM may take (H100: 227 KiB per block).
SHARED_MEMORY_BUDGET = 192 * 1024
# Tiny tiles for the CPU interpreter (tests): same code paths, fewer wasted lanes.
INTERPRETER_CONFIG = MoeConfig(16, GemmConfig(16, 16, 1, 1), GemmConfig(16, 16, 1, 1))


def get_config(
    num_tokens: int, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> MoeConfig:
    """The launch configuration for a batch of num_tokens tokens of `dtype` on `device`."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    cfg = next(cfg for bound, cfg in MOE_CONFIGS if num_tokens <= bound)
    return _fit_shared_memory(cfg, torch.empty((), dtype=dtype).element_size())


def _fit_shared_memory(cfg: MoeConfig, elem_size: int) -> MoeConfig:
    """cfg with block_k (down to 32), then num_stages (down to 2), halved until each GEMM's
    pipelined tiles (activations [BM, BK] + 2 or 1 weight tiles [BK, BN] per stage) fit in
    SHARED_MEMORY_BUDGET; a no-op for the bf16 table."""

    def fit(g: GemmConfig, mats: int) -> GemmConfig:
        size = lambda g: g.num_stages * (cfg.block_m + mats * g.block_n) * g.block_k * elem_size
        while size(g) > SHARED_MEMORY_BUDGET and g.block_k > 32:
            g = replace(g, block_k=g.block_k // 2)
        while size(g) > SHARED_MEMORY_BUDGET and g.num_stages > 2:
            g = replace(g, num_stages=g.num_stages - 1)
        return g

    return replace(cfg, gate_up=fit(cfg.gate_up, 2), down=fit(cfg.down, 1))


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
) -> torch.Tensor:
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
    config : launch configuration (default: get_config(T)).
    w13_scale, w2_scale : MXFP4 weights only: w13 is then uint8 [E, 2I, H/2] and w2 uint8
        [E, H, I/2] (E2M1 pairs along the input dim, low nibble first) and these are their uint8
        E8M0 scales [E, 2I, H/32] and [E, H, I/32]; dequantised inside the kernels.

    Returns
    -------
    [T, H], hidden_states.dtype.
    """
    mxfp4 = w13.dtype == torch.uint8
    _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    if mxfp4:
        _check_mxfp4(hidden_states, w13, w13_scale, w2, w2_scale)
    T, H = hidden_states.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    s13 = w13_scale if mxfp4 else w13  # (a dummy pointer when not MXFP4)
    s2 = w2_scale if mxfp4 else w2
    dtype, dev = hidden_states.dtype, hidden_states.device
    if T == 0:
        return torch.zeros_like(hidden_states)
    cfg = config or get_config(T, dev, dtype)
    if mxfp4:  # whole scale groups per K block
        cfg = _fit_mxfp4(cfg)
    align = moe_align_block_size(topk_ids, E, cfg.block_m)
    rows = align.max_blocks * cfg.block_m
    act = torch.empty(rows, inter, dtype=dtype, device=dev)  # [padded rows, I]
    prec = _dot_precision(dtype)
    upcast = dev.type != "cuda"  # interpreter: fp32 dot (its bf16 dot is wrong)
    g = cfg.gate_up
    grid = (align.max_blocks * triton.cdiv(inter, g.block_n),)
    moe_gate_up_kernel[grid](
        hidden_states,
        w13,
        s13,
        w13_bias if w13_bias is not None else w13,
        act,
        align.sorted_token_ids,
        align.expert_ids,
        align.num_tokens_post_padded,
        align.num_pairs,
        inter,
        H,
        align.max_blocks,
        hidden_states.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0,
        act.stride(0),
        float(swiglu_alpha),
        float(swiglu_limit),
        TOP_K=k,
        ACTIVATION=activation,
        HAS_BIAS=w13_bias is not None,
        DOT_PRECISION=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=g.block_n,
        BLOCK_K=g.block_k,
        GROUP_M=g.group_m,
        EVEN_K=H % g.block_k == 0,
        UPCAST=upcast,
        MXFP4=mxfp4,
        num_warps=g.num_warps,
        num_stages=g.num_stages,
    )
    out = torch.empty(T * k, H, dtype=dtype, device=dev)  # [T*k, H], pair order
    d = cfg.down
    grid = (align.max_blocks * triton.cdiv(H, d.block_n),)
    moe_down_kernel[grid](
        act,
        w2,
        s2,
        w2_bias if w2_bias is not None else w2,
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
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        w2_bias.stride(0) if w2_bias is not None else 0,
        out.stride(0),
        HAS_BIAS=w2_bias is not None,
        DOT_PRECISION=prec,
        BLOCK_M=cfg.block_m,
        BLOCK_N=d.block_n,
        BLOCK_K=d.block_k,
        GROUP_M=d.group_m,
        EVEN_K=inter % d.block_k == 0,
        UPCAST=upcast,
        MXFP4=mxfp4,
        num_warps=d.num_warps,
        num_stages=d.num_stages,
    )
    return out.view(T, k, H).sum(dim=1)  # top-k combine -> [T, H]


def _fit_mxfp4(cfg: MoeConfig) -> MoeConfig:
    """cfg with every block_k a multiple of 32 (one MXFP4 scale group)."""
    fit = lambda g: replace(g, block_k=max(32, g.block_k // 32 * 32))
    return replace(cfg, gate_up=fit(cfg.gate_up), down=fit(cfg.down))


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

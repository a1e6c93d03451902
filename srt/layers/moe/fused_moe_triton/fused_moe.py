"""`fused_experts`: routed experts on Triton (align, gate/up GEMM + activation, down GEMM + bias
+ routing weight, top-k sum), and the launch configurations by token count.

Static shapes throughout (buffers sized from T, k, E and the block size only), no host sync: the
call can be captured in a CUDA graph and replayed with other routings.
"""

from __future__ import annotations

from dataclasses import dataclass

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


# Upper bound on T -> config. Decode (few pairs per expert) is weight-read bound: BLOCK_M 16,
# narrow N tiles so enough programs stream weights, deep pipelines; prefill grows BLOCK_M.
# H100 bf16 starting points; benchmarks/bench_moe.py --sweep measures the alternatives.
MOE_CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (32, MoeConfig(16, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))),
    (128, MoeConfig(16, GemmConfig(64, 128, 4, 3), GemmConfig(64, 128, 4, 4))),
    (1024, MoeConfig(32, GemmConfig(64, 64, 4, 4, 8), GemmConfig(128, 64, 4, 4, 8))),
    (1 << 62, MoeConfig(64, GemmConfig(64, 64, 4, 4, 8), GemmConfig(128, 64, 8, 4, 8))),
)
# Tiny tiles for the CPU interpreter (tests): same code paths, fewer wasted lanes.
INTERPRETER_CONFIG = MoeConfig(16, GemmConfig(16, 16, 1, 1), GemmConfig(16, 16, 1, 1))


def get_config(num_tokens: int, device: torch.device) -> MoeConfig:
    """The launch configuration for a batch of num_tokens tokens on `device`."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    return next(cfg for bound, cfg in MOE_CONFIGS if num_tokens <= bound)


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

    Returns
    -------
    [T, H], hidden_states.dtype.
    """
    _check(hidden_states, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    T, H = hidden_states.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    k = topk_ids.shape[1]
    dtype, dev = hidden_states.dtype, hidden_states.device
    if T == 0:
        return torch.zeros_like(hidden_states)
    cfg = config or get_config(T, dev)
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
        num_warps=g.num_warps,
        num_stages=g.num_stages,
    )
    out = torch.empty(T * k, H, dtype=dtype, device=dev)  # [T*k, H], pair order
    d = cfg.down
    grid = (align.max_blocks * triton.cdiv(H, d.block_n),)
    moe_down_kernel[grid](
        act,
        w2,
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
        num_warps=d.num_warps,
        num_stages=d.num_stages,
    )
    return out.view(T, k, H).sum(dim=1)  # top-k combine -> [T, H]


def _check(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation) -> None:
    """Metadata-only argument checks (no device sync), before any launch."""
    if activation not in ("swiglu_oai", "silu"):
        raise ValueError(f"activation must be 'swiglu_oai' or 'silu', got {activation!r}")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"hidden_states must be [T, H] with contiguous rows, got {tuple(x.shape)}")
    T, H = x.shape
    if w13.dim() != 3 or w13.shape[2] != H or w13.shape[1] % 2 or not w13.is_contiguous():
        raise ValueError(f"w13 must be contiguous [E, 2I, H={H}], got {tuple(w13.shape)}")
    E, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, H, inter) or not w2.is_contiguous():
        raise ValueError(f"w2 must be contiguous [E={E}, H={H}, I={inter}], got {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"w13/w2 dtype {w13.dtype}/{w2.dtype} != hidden_states dtype {x.dtype}")
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

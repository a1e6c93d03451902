"""Launch configurations of the routed-expert kernels, by token count, weight format and dtype.

`get_config(T, device, dtype, mxfp4)` picks a row of the measured tables (bf16 experts:
MOE_CONFIGS, MXFP4 experts: MXFP4_CONFIGS, with a GPU's own rows from
MXFP4_DEVICE_OVERRIDES first), shrunk where its pipelined tiles would not fit in shared memory
(fp32), and the interpreter's tiny tiles off CUDA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from sgl_ext.device_tables import device_tables

MXFP4_MODES = ("dot_scaled", "split")


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's launch configuration.

    scale_prefetch (MXFP4 weights only): 1 loads the E8M0 scales one K block ahead into
    registers; 0 in the block that uses them (a memory round trip per K block: the scale rows
    are too narrow for the pipeliner's asynchronous copies).
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 1
    scale_prefetch: int = 1


@dataclass(frozen=True)
class MoeConfig:
    """Both GEMMs' configurations; block_m is shared (the alignment's block size).

    mxfp4_mode (MXFP4 weights only): "dot_scaled" (Triton's scaled dot, bf16/fp16 activations)
    or "split" (even/odd K halves, bit-arithmetic dequantisation; any dtype); see
    fused_moe_triton_kernels.py.
    gemv: True runs the per-pair CUDA-core kernels of moe_gemv.py instead (no alignment; only
    each GEMM's block_n, block_k, num_warps and num_stages apply).
    fp16_products (gemv with MXFP4 weights, bf16 activations and gpt-oss's bounded
    activation): multiply in fp16 pairs, moe_gemv_f16.py; False keeps the float32 GEMV.
    """

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    mxfp4_mode: str = "dot_scaled"
    gemv: bool = False
    fp16_products: bool = True


# Upper bound on T -> config, measured on the H100 (bf16 activations and experts, gpt-oss-20b
# shape, CUDA graph; benchmarks/bench_moe.py --sweep; the µs per row: benchmarks/RESULTS.md 8).
# Decode (few pairs per expert) is weight-read bound: BLOCK_M 16, narrow N tiles so enough
# programs stream weights, long K blocks; prefill grows BLOCK_M and the N tiles.
MOE_CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    # T <= 4: the per-pair GEMV kernels (each pair reads its own expert; no 16-row tile, no
    # alignment), faster than the grouped kernels there (bench_moe --sweep-gemv)
    (1, MoeConfig(16, GemmConfig(8, 256, 2, 2), GemmConfig(8, 512, 4, 1), gemv=True)),
    (2, MoeConfig(16, GemmConfig(8, 256, 2, 2), GemmConfig(8, 512, 4, 1), gemv=True)),
    (4, MoeConfig(16, GemmConfig(16, 512, 4, 1), GemmConfig(8, 512, 4, 1), gemv=True)),
    # grouped kernels from 5 tokens
    (8, MoeConfig(16, GemmConfig(32, 256, 4, 3, 1), GemmConfig(64, 128, 4, 4, 1))),
    (32, MoeConfig(16, GemmConfig(32, 256, 4, 3, 1), GemmConfig(64, 256, 4, 3, 1))),
    (64, MoeConfig(16, GemmConfig(32, 256, 4, 3, 1), GemmConfig(64, 256, 4, 3, 1))),
    (512, MoeConfig(64, GemmConfig(64, 64, 4, 4, 8), GemmConfig(128, 64, 4, 4, 8))),
    (1 << 62, MoeConfig(128, GemmConfig(128, 64, 8, 3, 8), GemmConfig(256, 64, 8, 3, 8))),
)
# MXFP4 experts (H100; `bench_moe.py --mxfp4 --sweep` / `--sweep-gemv`; the µs per row:
# benchmarks/RESULTS.md 8). A weight tile is BLOCK_K / 2 bytes a row, so decode takes long K
# blocks (128-byte row segments per load) and deep pipelines to keep enough bytes in flight.
MXFP4_CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    # T <= 8: the per-pair GEMV kernels with fp16 products (moe_gemv_f16.py), faster than the
    # float32 GEMV and the grouped kernels up to 8 tokens (not at 16); one-warp programs of 2-4
    # rows keep more programs in flight
    (
        1,
        MoeConfig(16, GemmConfig(2, 1024, 1, 2), GemmConfig(4, 1024, 2, 2), gemv=True),
    ),
    (
        2,
        MoeConfig(16, GemmConfig(2, 1024, 1, 2), GemmConfig(16, 256, 4, 2), gemv=True),
    ),
    (
        4,
        MoeConfig(16, GemmConfig(4, 512, 1, 2), GemmConfig(4, 512, 1, 2), gemv=True),
    ),
    (
        8,
        MoeConfig(16, GemmConfig(4, 512, 1, 2), GemmConfig(4, 512, 1, 2), gemv=True),
    ),
    # 8 < T <= 64: grouped kernels, the E8M0 scales loaded one K step ahead (the pipeliner
    # cannot copy rows that narrow asynchronously)
    (
        32,
        MoeConfig(16, GemmConfig(64, 128, 4, 4, 1, 1), GemmConfig(64, 128, 4, 4, 1, 1)),
    ),
    (
        64,
        MoeConfig(16, GemmConfig(64, 128, 4, 4, 1, 1), GemmConfig(64, 128, 4, 4, 1, 1)),
    ),
    (512, MoeConfig(64, GemmConfig(64, 128, 4, 4, 8), GemmConfig(128, 128, 4, 3, 8))),
    (1 << 62, MoeConfig(128, GemmConfig(64, 128, 8, 3, 8), GemmConfig(128, 128, 8, 3, 8))),
)
# Rows another GPU measured better, keyed by a substring of its name (torch.cuda.
# get_device_name): on such a GPU a row here takes the token counts up to its bound before
# MXFP4_CONFIGS does.
MXFP4_DEVICE_OVERRIDES: dict[str, tuple[tuple[int, MoeConfig], ...]] = {
    # H200 at T = 1: 4 rows a one-warp program and 512-element K blocks in both GEMVs (more
    # bytes in flight for its bandwidth than the H100 row)
    "H200": ((1, MoeConfig(16, GemmConfig(4, 512, 1, 2), GemmConfig(4, 512, 1, 2), gemv=True)),),
}
# Shared memory the pipelined operand tiles of one GEMM may take (H100: 227 KiB per block).
SHARED_MEMORY_BUDGET = 192 * 1024
# Tiny tiles for the CPU interpreter (tests): same code paths, fewer wasted lanes.
INTERPRETER_CONFIG = MoeConfig(16, GemmConfig(16, 16, 1, 1), GemmConfig(16, 16, 1, 1), "split")


def get_config(
    num_tokens: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    mxfp4: bool = False,
) -> MoeConfig:
    """The launch configuration for num_tokens tokens of `dtype` on `device` (MXFP4 experts:
    mxfp4=True; fp32 activations then take the "split" mode)."""
    if device.type != "cuda":
        return fit_mxfp4(INTERPRETER_CONFIG) if mxfp4 else INTERPRETER_CONFIG
    table = MXFP4_CONFIGS if mxfp4 else MOE_CONFIGS
    if mxfp4:
        table = _mxfp4_overrides(device) + table
    cfg = next(cfg for bound, cfg in table if num_tokens <= bound)
    if mxfp4 and dtype not in (torch.bfloat16, torch.float16):
        cfg = replace(cfg, mxfp4_mode="split")
    if cfg.gemv:  # no shared-memory tiles
        return cfg
    act_size = torch.empty((), dtype=dtype).element_size()
    return fit_shared_memory(cfg, act_size, 0.5 if mxfp4 else act_size)


@functools.cache
def _mxfp4_overrides(device: torch.device) -> tuple[tuple[int, MoeConfig], ...]:
    """The MXFP4_DEVICE_OVERRIDES rows whose name occurs in this device's name."""
    return tuple(row for t in device_tables(MXFP4_DEVICE_OVERRIDES, device) for row in t)


def fit_shared_memory(cfg: MoeConfig, act_size: int, weight_size: float) -> MoeConfig:
    """cfg with block_k (down to 32), then num_stages (down to 2), halved until each GEMM's
    pipelined tiles (activations [BM, BK] + 2 or 1 weight tiles [BK, BN] per stage, of
    act_size / weight_size bytes an element) fit in SHARED_MEMORY_BUDGET; a no-op for the
    bf16 and MXFP4 tables with bf16 activations."""

    def fit(g: GemmConfig, mats: int) -> GemmConfig:
        def size(g: GemmConfig) -> float:
            per_k = cfg.block_m * act_size + mats * g.block_n * weight_size
            return g.num_stages * g.block_k * per_k

        while size(g) > SHARED_MEMORY_BUDGET and g.block_k > 32:
            g = replace(g, block_k=g.block_k // 2)
        while size(g) > SHARED_MEMORY_BUDGET and g.num_stages > 2:
            g = replace(g, num_stages=g.num_stages - 1)
        return g

    return replace(cfg, gate_up=fit(cfg.gate_up, 2), down=fit(cfg.down, 1))


def fit_mxfp4(cfg: MoeConfig) -> MoeConfig:
    """cfg with every block_k a multiple of 32 (whole MXFP4 scale groups per K block)."""
    fit = lambda g: replace(g, block_k=max(32, g.block_k // 32 * 32))
    return replace(cfg, gate_up=fit(cfg.gate_up), down=fit(cfg.down))

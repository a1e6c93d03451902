"""Launch configurations of the routed-expert kernels, by token count, weight format and dtype.

`get_config(T, device, dtype, mxfp4)` picks a row of the measured table sgl_ext/tables/moe.json
(by expert weights and token count, a GPU's own rows first), shrunk where its pipelined tiles
would not fit in shared memory (fp32), and the interpreter's tiny tiles off CUDA.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from sgl_ext import launch_tables

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


EXPERTS = ("bf16", "mxfp4")
_KERNELS = ("grouped", "gemv")
_GEMM_KEYS = ("block_n", "block_k", "num_warps", "num_stages", "group_m", "scale_prefetch")


@dataclass(frozen=True)
class MoeRow:
    """A row of sgl_ext/tables/moe.json: `config` for first <= T <= last tokens (last None: no
    bound) with `experts` ("bf16" or "mxfp4") weights."""

    experts: str
    first: int
    last: int | None
    config: MoeConfig

    def covers(self, num_tokens: int) -> bool:
        return self.first <= num_tokens and (self.last is None or num_tokens <= self.last)


def _gemm(name: str, v: dict) -> GemmConfig:
    unknown = sorted(set(v) - set(_GEMM_KEYS))
    if unknown or not all(isinstance(x, int) and not isinstance(x, bool) for x in v.values()):
        raise ValueError(f"{name} takes integer {', '.join(_GEMM_KEYS)}, got {v}")
    g = GemmConfig(**v)
    if not all(_pow2(x) for x in (g.block_n, g.block_k, g.num_warps)) or g.num_stages < 1:
        raise ValueError(f"{name}: block_n, block_k, num_warps powers of two, num_stages >= 1")
    if g.group_m < 1 or g.scale_prefetch not in (0, 1):
        raise ValueError(f"{name}: group_m >= 1 and scale_prefetch 0 or 1")
    return g


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _row(row: dict) -> MoeRow:
    """A moe.json row: experts, tokens, kernel (grouped or gemv), block_m, gate_up and down
    (each GEMM's GemmConfig fields), then mxfp4_mode and fp16_products (MXFP4 rows)."""
    first, last = launch_tables.token_range(row)
    experts = launch_tables.take(row, "experts", str)
    kernel = launch_tables.take(row, "kernel", str)
    if experts not in EXPERTS or kernel not in _KERNELS:
        raise ValueError(f"experts must be one of {EXPERTS} and kernel one of {_KERNELS}")
    block_m = launch_tables.take(row, "block_m", int)
    if not _pow2(block_m) or block_m < 16:
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    gate_up = _gemm("gate_up", launch_tables.take(row, "gate_up", dict))
    down = _gemm("down", launch_tables.take(row, "down", dict))
    mode, fp16 = "dot_scaled", True
    if experts == "mxfp4":
        mode = launch_tables.take(row, "mxfp4_mode", str) if "mxfp4_mode" in row else mode
        fp16 = launch_tables.take(row, "fp16_products", bool) if "fp16_products" in row else fp16
    if mode not in MXFP4_MODES:
        raise ValueError(f"mxfp4_mode must be one of {MXFP4_MODES}, got {mode!r}")
    launch_tables.no_more(row)
    return MoeRow(
        experts, first, last, MoeConfig(block_m, gate_up, down, mode, kernel == "gemv", fp16)
    )


def _check(rows: tuple[MoeRow, ...], device: str | None) -> None:
    launch_tables.check_ranges(
        ((r.experts, r.first, r.last) for r in rows), device is None, "experts"
    )
    if device is None and {r.experts for r in rows} != set(EXPERTS):
        raise ValueError(f"the H100's rows must cover every experts kind {EXPERTS}")


def moe_table() -> launch_tables.LaunchTable[MoeRow]:
    """sgl_ext/tables/moe.json, loaded on first use."""
    return launch_tables.load("moe", _row, _check)


def table_row(cfg: MoeConfig, experts: str, first: int, last: int | None) -> dict[str, object]:
    """The moe.json row of `cfg` for first..last tokens (last None: no bound)."""

    def gemm(g: GemmConfig) -> dict[str, int]:
        d = {k: getattr(g, k) for k in _GEMM_KEYS}
        return {k: v for k, v in d.items() if k in _GEMM_KEYS[:4] or v != 1}

    row: dict[str, object] = {"experts": experts, "tokens": [first, last]}
    row.update(kernel="gemv" if cfg.gemv else "grouped", block_m=cfg.block_m)
    row.update(gate_up=gemm(cfg.gate_up), down=gemm(cfg.down))
    if experts == "mxfp4" and cfg.mxfp4_mode != "dot_scaled":
        row["mxfp4_mode"] = cfg.mxfp4_mode
    if experts == "mxfp4" and not cfg.fp16_products:
        row["fp16_products"] = False
    return row


def __getattr__(name: str) -> object:
    """The tables by their names in the code that held them (rows of moe.json): MOE_CONFIGS
    (bf16 experts), MXFP4_CONFIGS (MXFP4 experts), MXFP4_DEVICE_OVERRIDES (a GPU's own)."""
    if name in ("MOE_CONFIGS", "MXFP4_CONFIGS"):
        experts = "bf16" if name == "MOE_CONFIGS" else "mxfp4"
        return tuple(r for r in moe_table().rows if r.experts == experts)
    if name == "MXFP4_DEVICE_OVERRIDES":
        own = moe_table().devices.items()
        return {sub: tuple(r for r in rows if r.experts == "mxfp4") for sub, rows in own}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    cfg = next(c for lo, hi, c in _rows(moe_table(), device, mxfp4) if lo <= num_tokens <= hi)
    if mxfp4 and dtype not in (torch.bfloat16, torch.float16):
        cfg = replace(cfg, mxfp4_mode="split")
    if cfg.gemv:  # no shared-memory tiles
        return cfg
    act_size = torch.empty((), dtype=dtype).element_size()
    return fit_shared_memory(cfg, act_size, 0.5 if mxfp4 else act_size)


@functools.cache
def _rows(
    table: launch_tables.LaunchTable[MoeRow], device: torch.device, mxfp4: bool
) -> tuple[tuple[int, float, MoeConfig], ...]:
    """(first, last, config) of the rows a call on `device` reads, in order: its GPU's own,
    then the H100's (one GPU per device index: cached)."""
    experts = "mxfp4" if mxfp4 else "bf16"
    rows = (r for r in table.rows_for(device) if r.experts == experts)
    return tuple((r.first, math.inf if r.last is None else r.last, r.config) for r in rows)


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

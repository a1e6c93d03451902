"""Which kernel runs a decode linear: F.linear (cuBLAS) or sgl_ext's skinny Triton GEMM.

One table, `GEMM_CHOICES`, maps (N, K, M bucket) of a linear - its local weight [N, K] and the
token count rounded up to a power of two (1, 2, 4, ..., 64) - to the Triton launch configuration
that `benchmarks/bench_gemm.py` measured faster than F.linear on the H100 (it prints the lines to
paste here). `DEVICE_OVERRIDES` replaces rows on a GPU (by name) where another choice measured
better end to end. A call whose key is absent, or that is not on CUDA, not bf16/fp16, has more
than 64 rows, or is traced by torch.compile, runs F.linear (an empty table: F.linear everywhere).

Graph and eager agree bit for bit: the key depends only on the weight's shape and the M bucket,
and a CUDA-graph bucket of the runner (1, 2, 4, 8, then multiples of 8) has the same power-of-two
bucket as every batch size it serves; the kernel's rows do not depend on the other rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from sgl_ext._common import next_pow2
from sgl_ext.device_tables import device_tables
from sgl_ext.gemm import MAX_M, GemmConfig, linear_small_m, linear_small_m_native

_DTYPES = (torch.bfloat16, torch.float16)
_is_compiling = torch.compiler.is_compiling


def _fma(block_n: int, block_k: int, num_warps: int, num_stages: int) -> GemmConfig:
    """Broadcast multiply + sum tiles (no split-K)."""
    return GemmConfig(block_n, block_k, num_warps, num_stages, split_k=1, dot=False)


def _dot(block_n: int, block_k: int, num_warps: int, num_stages: int) -> GemmConfig:
    """Swap-AB tensor-core dot tiles (no split-K)."""
    return GemmConfig(block_n, block_k, num_warps, num_stages, split_k=1, dot=True)


# (N, K, M bucket) -> GemmConfig, from bench_gemm.py's "GEMM_CHOICES" lines (H100, bf16;
# session of 2026-11-24, commit 1a1d00e + the select_backend fix; M <= 2 re-swept in session 7
# of 2026-11-26 with long K blocks: the broadcast path's loads are not pipelined, so one or two
# K blocks of 2-4K elements on 1-4 rows per program beat 1K blocks). Comments: the linear, then
# µs per call in a CUDA graph, Triton vs F.linear (M <= 2: H100, mean of two runs).
GEMM_CHOICES: dict[tuple[int, int, int], GemmConfig] = {
    (4096, 4096, 1): _fma(1, 4096, 4, 1),  # o_proj 12.6 vs 16.6 (was 15.1)
    (6144, 4096, 1): _fma(2, 2048, 4, 1),  # qkv 17.9 vs 21.0 (was 21.1)
    (4096, 14336, 1): _fma(2, 2048, 4, 1),  # down 40.6 vs 44.5 (was 45.4)
    (28672, 4096, 1): _fma(1, 4096, 4, 1),  # gate_up 75.9 vs 82.3 (was 79.0)
    (4096, 12288, 1): _fma(1, 4096, 4, 1),  # down 34.4 vs 39.6 (was 39.6)
    (24576, 4096, 1): _fma(1, 4096, 4, 1),  # gate_up 65.4 vs 72.6 (was 67.3)
    (2880, 4096, 1): _fma(4, 2048, 4, 1),  # o_proj 10.1 vs 13.7 (was 12.1)
    (5120, 2880, 1): _fma(4, 1024, 2, 3),  # qkv 12.3 vs 13.2 (one run; was 13.7)
    (32, 2880, 1): _fma(1, 4096, 4, 1),  # gpt-oss router 1.9 vs 6.9 (was 3.7)
    (4096, 4096, 2): _dot(64, 256, 4, 4),  # o_proj 13.2 vs 16.3 (was 16.0)
    (6144, 4096, 2): _dot(64, 256, 4, 3),  # qkv 19.1 vs 21.2
    (4096, 14336, 2): _fma(4, 2048, 2, 1),  # down 42.4 vs 44.6 (was F.linear)
    (4096, 12288, 2): _fma(2, 4096, 4, 1),  # down 37.6 vs 40.0 (was 44.1)
    (24576, 4096, 2): _dot(64, 128, 4, 3),  # gate_up 68.6 vs 72.7
    (2880, 4096, 2): _fma(2, 2048, 4, 1),  # o_proj 11.0 vs 14.3 (was 15.3)
    (32, 2880, 2): _fma(1, 4096, 8, 1),  # gpt-oss router 2.0 vs 6.9 (was F.linear)
    (4096, 4096, 4): _dot(64, 256, 4, 5),  # o_proj 14.0 vs 16.5
    (6144, 4096, 4): _dot(64, 256, 4, 3),  # qkv 19.1 vs 21.1 (session 7; was s4 20.0)
    (4096, 14336, 4): _dot(64, 256, 4, 5),  # down 42.6 vs 44.5
    (28672, 4096, 4): _dot(64, 256, 4, 4),  # gate_up 80.5 vs 86.5
    (4096, 12288, 4): _dot(64, 256, 4, 5),  # down 37.1 vs 39.8
    (24576, 4096, 4): _dot(64, 128, 4, 5),  # gate_up 69.5 vs 73.4
    (2880, 4096, 4): _dot(64, 256, 4, 5),  # o_proj 11.4 vs 14.3
    (5120, 2880, 4): _dot(64, 256, 4, 4),  # qkv 13.0 vs 13.5
    (4096, 4096, 8): _dot(64, 256, 4, 4),  # o_proj 14.0 vs 16.4
    (6144, 4096, 8): _dot(64, 256, 4, 3),  # qkv 19.2 vs 21.2 (session 7; was s4 20.4)
    (4096, 14336, 8): _dot(64, 256, 4, 5),  # down 43.0 vs 44.9
    (4096, 12288, 8): _dot(64, 256, 4, 5),  # down 37.5 vs 40.2
    (24576, 4096, 8): _dot(64, 128, 4, 3),  # gate_up 69.0 vs 73.2 (session 7; was n32 77.8)
    (28672, 4096, 8): _dot(64, 256, 4, 4),  # gate_up 80.4 vs 86.5 (session 7)
    (32, 2880, 4): _fma(1, 4096, 8, 1),  # gpt-oss router 2.4 vs 6.9 (session 7)
    (32, 2880, 8): GemmConfig(1, 2048, 4, 1, split_k=2, dot=False),  # gpt-oss router 3.3 vs 6.9
    (2880, 4096, 8): _dot(64, 256, 4, 4),  # o_proj 11.5 vs 14.2
    (4096, 4096, 16): _dot(64, 256, 4, 4),  # o_proj 14.0 vs 16.6
    (6144, 4096, 16): _dot(64, 256, 4, 3),  # qkv 19.9 vs 21.1
    (4096, 14336, 16): _dot(64, 256, 4, 5),  # down 43.0 vs 45.4
    (28672, 4096, 16): _dot(64, 256, 4, 4),  # gate_up 81.9 vs 86.7
    (4096, 12288, 16): _dot(64, 256, 4, 5),  # down 38.1 vs 40.5
    (24576, 4096, 16): _dot(64, 128, 4, 3),  # gate_up 70.1 vs 74.2
    (2880, 4096, 16): _dot(64, 256, 4, 4),  # o_proj 11.4 vs 14.7
    (6144, 4096, 32): _dot(64, 256, 4, 4),  # qkv 20.7 vs 21.7
    (28672, 4096, 32): _dot(128, 128, 4, 4),  # gate_up 82.4 vs 85.1
    (4096, 12288, 32): _dot(16, 256, 4, 5),  # down 39.5 vs 41.0
    (24576, 4096, 32): _dot(64, 128, 4, 3),  # gate_up 71.1 vs 74.7
    (2880, 4096, 32): _dot(64, 256, 4, 4),  # o_proj 12.8 vs 15.1
    (28672, 4096, 64): _dot(64, 128, 4, 3),  # gate_up 84.9 vs 87.6
    # LM heads (once a step; `bench_gemm.py --lm-head --m 1 2 4 8 --sweep quick`, then --m 16 32
    # 64, H100, session 14): µs per call, Triton vs F.linear (floor: the weight over the copy
    # bandwidth; the Triton kernel streams at 0.94-1.01x it)
    (128256, 4096, 1): _fma(2, 4096, 8, 1),  # llama3-8b 330.6 vs 395.0 (floor 352.4)
    (151936, 4096, 1): _fma(2, 4096, 4, 1),  # qwen3-8b 392.6 vs 438.4 (floor 417.5)
    (201088, 2880, 1): _fma(4, 4096, 4, 1),  # gpt-oss-20b 375.9 vs 411.5 (floor 388.5)
    (128256, 4096, 2): _dot(64, 256, 4, 5),  # llama3-8b 341.2 vs 372.1
    (151936, 4096, 2): _dot(64, 256, 4, 5),  # qwen3-8b 401.5 vs 435.2
    (201088, 2880, 2): _dot(64, 256, 4, 4),  # gpt-oss-20b 379.6 vs 410.0
    (128256, 4096, 4): _dot(64, 256, 4, 4),  # llama3-8b 343.2 vs 375.4
    (151936, 4096, 4): _dot(64, 256, 4, 4),  # qwen3-8b 405.0 vs 439.4
    (201088, 2880, 4): _dot(64, 256, 4, 4),  # gpt-oss-20b 379.0 vs 414.2
    (128256, 4096, 8): _dot(64, 256, 4, 3),  # llama3-8b 346.7 vs 382.8
    (151936, 4096, 8): _dot(64, 256, 4, 4),  # qwen3-8b 405.7 vs 442.5
    (201088, 2880, 8): _dot(64, 256, 4, 5),  # gpt-oss-20b 383.1 vs 414.9
    (128256, 4096, 16): _dot(64, 256, 4, 4),  # llama3-8b 348.1 vs 379.6
    (151936, 4096, 16): _dot(64, 256, 4, 4),  # qwen3-8b 411.0 vs 441.2
    (201088, 2880, 16): _dot(64, 256, 4, 4),  # gpt-oss-20b 390.1 vs 417.3
    (128256, 4096, 32): _dot(128, 128, 4, 3),  # llama3-8b 352.8 vs 383.6
    (151936, 4096, 32): _dot(128, 128, 4, 3),  # qwen3-8b 417.0 vs 445.1
    (201088, 2880, 32): _dot(128, 128, 4, 4),  # gpt-oss-20b 402.2 vs 423.2
    (128256, 4096, 64): _dot(128, 128, 8, 3),  # llama3-8b 359.1 vs 390.9
    (151936, 4096, 64): _dot(128, 128, 8, 3),  # qwen3-8b 423.8 vs 455.5
    (201088, 2880, 64): _dot(64, 128, 4, 5),  # gpt-oss-20b 416.4 vs 440.9
}

# Rows another GPU measured better with a different choice, keyed by a substring of its name
# (torch.cuda.get_device_name): applied over GEMM_CHOICES on such a device (None: F.linear).
DEVICE_OVERRIDES: dict[str, dict[tuple[int, int, int], GemmConfig | None]] = {
    # H200 (session 7): with the M = 1 Llama / Qwen rows above, bs-1 decode went from 5.58 to
    # 5.97-6.09 ms (Llama-3-8B) and 5.93 to 6.23-6.33 ms (Qwen3-8B) against the rows before
    # the re-sweep, kept here for it; gpt-oss's new rows gained there too.
    "H200": {
        (4096, 4096, 1): _fma(4, 1024, 2, 3),
        (6144, 4096, 1): _fma(8, 1024, 4, 3),
        (4096, 14336, 1): _fma(4, 1024, 2, 3),
        (28672, 4096, 1): _fma(4, 1024, 2, 3),
        (4096, 12288, 1): _fma(4, 1024, 2, 3),
        (24576, 4096, 1): _fma(4, 1024, 4, 3),
        # LM heads at M = 1 (session 22, `bench_gemm.py --lm-head --m 1 --sweep quick`, H200):
        # the H100's one-K-block FMA rows stream at 0.96-1.24x the floor there; µs, the new row
        # vs the H100 row (gpt-oss-20b bs-1 decode graph 1.711 -> 1.626 ms)
        (201088, 2880, 1): _dot(64, 128, 4, 5),  # gpt-oss-20b 260.3 vs 342.3 (floor 275.6)
        (128256, 4096, 1): _dot(64, 128, 4, 3),  # llama3-8b 235.6 vs 274.5 (floor 249.7)
        (151936, 4096, 1): _dot(64, 128, 8, 3),  # qwen3-8b 278.3 vs 284.9 (floor 295.8)
    },
}

_table: Mapping[tuple[int, int, int], GemmConfig] = GEMM_CHOICES
# choose_config's answers for CUDA tensors, per (N, K, M <= MAX_M, dtype): one dict lookup per
# linear call instead of the checks and the bucket; emptied whenever the table changes (one GPU
# model per process: the key holds no device).
_chosen: dict[tuple[int, int, int, torch.dtype], GemmConfig | None] = {}
_MISS = object()


def m_bucket(m: int) -> int:
    """The table's M key: m rounded up to a power of two (m >= 1)."""
    return next_pow2(m)


def choose_config(
    n: int, k: int, m: int, dtype: torch.dtype, device: torch.device
) -> GemmConfig | None:
    """The Triton configuration for a [m, k] x [n, k]^T linear, or None for F.linear."""
    if not _table or device.type != "cuda" or dtype not in _DTYPES or not 1 <= m <= MAX_M:
        return None
    key = (n, k, m_bucket(m))
    if _table is GEMM_CHOICES and any(key in t for t in DEVICE_OVERRIDES.values()):
        rows = _overrides(device)  # the shipped table: this GPU's measured exceptions first
        if key in rows:
            return rows[key]
    return _table.get(key)


def _overrides(device: torch.device) -> dict[tuple[int, int, int], GemmConfig | None]:
    """The DEVICE_OVERRIDES rows whose name occurs in this device's name."""
    return {k: v for t in device_tables(DEVICE_OVERRIDES, device) for k, v in t.items()}


def dispatch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the skinny Triton GEMM where the table says so.

    Parameters
    ----------
    x : [..., K] model dtype; weight : [N, K]; bias : [N] or None.
    out_dtype : None (x's dtype) or torch.float32: the same values widened (the skinny GEMM
        stores them so itself; F.linear's result is cast).

    Returns
    -------
    [..., N], out_dtype.
    """
    cfg = linear_config(x, weight)
    if cfg is not None:
        return linear_small_m(x, weight, bias, cfg, out_dtype=out_dtype)
    return linear_small_m_native(x, weight, bias, out_dtype)


def linear_config(x: torch.Tensor, weight: torch.Tensor) -> GemmConfig | None:
    """The skinny GEMM's configuration that `dispatch_linear(x, weight)` runs, or None where it
    runs F.linear (memoised per shape, M and dtype)."""
    if _table and x.is_cuda and not _is_compiling():
        n, k = weight.shape
        m = x.numel() // k if k else 0
        if m <= MAX_M:
            key = (n, k, m, x.dtype)
            cfg = _chosen.get(key, _MISS)
            if cfg is _MISS:
                cfg = _chosen[key] = choose_config(n, k, m, x.dtype, x.device)
            assert cfg is None or isinstance(cfg, GemmConfig)
            if cfg is not None and weight.dtype == x.dtype:
                return cfg
    return None


@contextlib.contextmanager
def use_gemm_choices(table: Mapping[tuple[int, int, int], GemmConfig]) -> Iterator[None]:
    """Replace the table for a `with` block (tests, benchmarks): {(N, K, M bucket): config}."""
    global _table
    for key, cfg in table.items():
        if len(key) != 3 or m_bucket(key[2]) != key[2] or not isinstance(cfg, GemmConfig):
            raise ValueError(f"table entry {key}: {cfg!r} is not (N, K, pow2 M) -> GemmConfig")
    before, _table = _table, table  # the caller's mapping (tests may pass a catch-all)
    _chosen.clear()
    try:
        yield
    finally:
        _table = before
        _chosen.clear()

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

from sgl_ext.device_tables import device_tables
from sgl_ext.gemm import MAX_M, GemmConfig, linear_small_m, linear_small_m_native
from sgl_ext.launch import next_pow2

_DTYPES = (torch.bfloat16, torch.float16)
_is_compiling = torch.compiler.is_compiling


def _fma(block_n: int, block_k: int, num_warps: int, num_stages: int) -> GemmConfig:
    """Broadcast multiply + sum tiles (no split-K)."""
    return GemmConfig(block_n, block_k, num_warps, num_stages, split_k=1, dot=False)


def _dot(block_n: int, block_k: int, num_warps: int, num_stages: int) -> GemmConfig:
    """Swap-AB tensor-core dot tiles (no split-K)."""
    return GemmConfig(block_n, block_k, num_warps, num_stages, split_k=1, dot=True)


# (N, K, M bucket) -> GemmConfig, from bench_gemm.py's "GEMM_CHOICES" lines (H100, bf16): each
# row beat F.linear on its linear (the comment) in CUDA graphs over L2-cold weights; the µs per
# row are benchmarks/RESULTS.md 6.2. At M <= 2 one or two K blocks of 2-4K elements on 1-4 rows
# a program: the broadcast path's loads are not pipelined, so each K block is a round trip.
GEMM_CHOICES: dict[tuple[int, int, int], GemmConfig] = {
    (4096, 4096, 1): _fma(1, 4096, 4, 1),  # Llama-3-8B / Qwen3-8B o_proj
    (6144, 4096, 1): _fma(2, 2048, 4, 1),  # Llama-3-8B / Qwen3-8B qkv
    (4096, 14336, 1): _fma(2, 2048, 4, 1),  # Llama-3-8B down
    (28672, 4096, 1): _fma(1, 4096, 4, 1),  # Llama-3-8B gate_up
    (4096, 12288, 1): _fma(1, 4096, 4, 1),  # Qwen3-8B down
    (24576, 4096, 1): _fma(1, 4096, 4, 1),  # Qwen3-8B gate_up
    (2880, 4096, 1): _fma(4, 2048, 4, 1),  # gpt-oss-20b o_proj
    (5120, 2880, 1): _fma(4, 1024, 2, 3),  # gpt-oss-20b qkv
    (32, 2880, 1): _fma(1, 4096, 4, 1),  # gpt-oss-20b router
    (4096, 4096, 2): _dot(64, 256, 4, 4),  # Llama-3-8B / Qwen3-8B o_proj
    (6144, 4096, 2): _dot(64, 256, 4, 3),  # Llama-3-8B / Qwen3-8B qkv
    (4096, 14336, 2): _fma(4, 2048, 2, 1),  # Llama-3-8B down
    (4096, 12288, 2): _fma(2, 4096, 4, 1),  # Qwen3-8B down
    (24576, 4096, 2): _dot(64, 128, 4, 3),  # Qwen3-8B gate_up
    (2880, 4096, 2): _fma(2, 2048, 4, 1),  # gpt-oss-20b o_proj
    (32, 2880, 2): _fma(1, 4096, 8, 1),  # gpt-oss-20b router
    (4096, 4096, 4): _dot(64, 256, 4, 5),  # Llama-3-8B / Qwen3-8B o_proj
    (6144, 4096, 4): _dot(64, 256, 4, 3),  # Llama-3-8B / Qwen3-8B qkv
    (4096, 14336, 4): _dot(64, 256, 4, 5),  # Llama-3-8B down
    (28672, 4096, 4): _dot(64, 256, 4, 4),  # Llama-3-8B gate_up
    (4096, 12288, 4): _dot(64, 256, 4, 5),  # Qwen3-8B down
    (24576, 4096, 4): _dot(64, 128, 4, 5),  # Qwen3-8B gate_up
    (2880, 4096, 4): _dot(64, 256, 4, 5),  # gpt-oss-20b o_proj
    (5120, 2880, 4): _dot(64, 256, 4, 4),  # gpt-oss-20b qkv
    (4096, 4096, 8): _dot(64, 256, 4, 4),  # Llama-3-8B / Qwen3-8B o_proj
    (6144, 4096, 8): _dot(64, 256, 4, 3),  # Llama-3-8B / Qwen3-8B qkv
    (4096, 14336, 8): _dot(64, 256, 4, 5),  # Llama-3-8B down
    (4096, 12288, 8): _dot(64, 256, 4, 5),  # Qwen3-8B down
    (24576, 4096, 8): _dot(64, 128, 4, 3),  # Qwen3-8B gate_up
    (28672, 4096, 8): _dot(64, 256, 4, 4),  # Llama-3-8B gate_up
    (32, 2880, 4): _fma(1, 4096, 8, 1),  # gpt-oss-20b router
    (32, 2880, 8): GemmConfig(1, 2048, 4, 1, split_k=2, dot=False),  # gpt-oss-20b router
    (2880, 4096, 8): _dot(64, 256, 4, 4),  # gpt-oss-20b o_proj
    (4096, 4096, 16): _dot(64, 256, 4, 4),  # Llama-3-8B / Qwen3-8B o_proj
    (6144, 4096, 16): _dot(64, 256, 4, 3),  # Llama-3-8B / Qwen3-8B qkv
    (4096, 14336, 16): _dot(64, 256, 4, 5),  # Llama-3-8B down
    (28672, 4096, 16): _dot(64, 256, 4, 4),  # Llama-3-8B gate_up
    (4096, 12288, 16): _dot(64, 256, 4, 5),  # Qwen3-8B down
    (24576, 4096, 16): _dot(64, 128, 4, 3),  # Qwen3-8B gate_up
    (2880, 4096, 16): _dot(64, 256, 4, 4),  # gpt-oss-20b o_proj
    (6144, 4096, 32): _dot(64, 256, 4, 4),  # Llama-3-8B / Qwen3-8B qkv
    (28672, 4096, 32): _dot(128, 128, 4, 4),  # Llama-3-8B gate_up
    (4096, 12288, 32): _dot(16, 256, 4, 5),  # Qwen3-8B down
    (24576, 4096, 32): _dot(64, 128, 4, 3),  # Qwen3-8B gate_up
    (2880, 4096, 32): _dot(64, 256, 4, 4),  # gpt-oss-20b o_proj
    (28672, 4096, 64): _dot(64, 128, 4, 3),  # Llama-3-8B gate_up
    # LM heads, the largest GEMM of a decode step (`bench_gemm.py --lm-head`)
    (128256, 4096, 1): _fma(2, 4096, 8, 1),  # Llama-3-8B LM head
    (151936, 4096, 1): _fma(2, 4096, 4, 1),  # Qwen3-8B LM head
    (201088, 2880, 1): _fma(4, 4096, 4, 1),  # gpt-oss-20b LM head
    (128256, 4096, 2): _dot(64, 256, 4, 5),  # Llama-3-8B LM head
    (151936, 4096, 2): _dot(64, 256, 4, 5),  # Qwen3-8B LM head
    (201088, 2880, 2): _dot(64, 256, 4, 4),  # gpt-oss-20b LM head
    (128256, 4096, 4): _dot(64, 256, 4, 4),  # Llama-3-8B LM head
    (151936, 4096, 4): _dot(64, 256, 4, 4),  # Qwen3-8B LM head
    (201088, 2880, 4): _dot(64, 256, 4, 4),  # gpt-oss-20b LM head
    (128256, 4096, 8): _dot(64, 256, 4, 3),  # Llama-3-8B LM head
    (151936, 4096, 8): _dot(64, 256, 4, 4),  # Qwen3-8B LM head
    (201088, 2880, 8): _dot(64, 256, 4, 5),  # gpt-oss-20b LM head
    (128256, 4096, 16): _dot(64, 256, 4, 4),  # Llama-3-8B LM head
    (151936, 4096, 16): _dot(64, 256, 4, 4),  # Qwen3-8B LM head
    (201088, 2880, 16): _dot(64, 256, 4, 4),  # gpt-oss-20b LM head
    (128256, 4096, 32): _dot(128, 128, 4, 3),  # Llama-3-8B LM head
    (151936, 4096, 32): _dot(128, 128, 4, 3),  # Qwen3-8B LM head
    (201088, 2880, 32): _dot(128, 128, 4, 4),  # gpt-oss-20b LM head
    (128256, 4096, 64): _dot(128, 128, 8, 3),  # Llama-3-8B LM head
    (151936, 4096, 64): _dot(128, 128, 8, 3),  # Qwen3-8B LM head
    (201088, 2880, 64): _dot(64, 128, 4, 5),  # gpt-oss-20b LM head
}

# Rows another GPU measured better with a different choice, keyed by a substring of its name
# (torch.cuda.get_device_name): applied over GEMM_CHOICES on such a device (None: F.linear).
DEVICE_OVERRIDES: dict[str, dict[tuple[int, int, int], GemmConfig | None]] = {
    # H200 (benchmarks/RESULTS.md 6.2): the Llama-3-8B / Qwen3-8B decoder linears at M = 1 keep
    # the rows from before the long-K re-sweep, whose rows were faster alone but made its decode
    # step slower.
    "H200": {
        (4096, 4096, 1): _fma(4, 1024, 2, 3),
        (6144, 4096, 1): _fma(8, 1024, 4, 3),
        (4096, 14336, 1): _fma(4, 1024, 2, 3),
        (28672, 4096, 1): _fma(4, 1024, 2, 3),
        (4096, 12288, 1): _fma(4, 1024, 2, 3),
        (24576, 4096, 1): _fma(4, 1024, 4, 3),
        # LM heads at M = 1: pipelined tensor-core tiles; the H100's one-K-block rows keep too
        # few bytes in flight for the H200's bandwidth
        (201088, 2880, 1): _dot(64, 128, 4, 5),  # gpt-oss-20b LM head
        (128256, 4096, 1): _dot(64, 128, 4, 3),  # Llama-3-8B LM head
        (151936, 4096, 1): _dot(64, 128, 8, 3),  # Qwen3-8B LM head
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

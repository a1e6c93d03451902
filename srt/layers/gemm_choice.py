"""Which kernel runs a decode linear: F.linear (cuBLAS) or sgl_ext's skinny Triton GEMM.

One table, `GEMM_CHOICES`, maps (N, K, M bucket) of a linear - its local weight [N, K] and the
token count rounded up to a power of two (1, 2, 4, ..., 64) - to the Triton launch configuration
that `benchmarks/bench_gemm.py` measured faster than F.linear on the H100 (it prints the lines to
paste here). A call whose key is absent, or that is not on CUDA, not bf16/fp16, has more than 64
rows, or is traced by torch.compile, runs F.linear as before: the empty table is today's
behaviour.

Graph and eager agree bit for bit: the key depends only on the weight's shape and the M bucket,
and a CUDA-graph bucket of the runner (1, 2, 4, 8, then multiples of 8) has the same power-of-two
bucket as every batch size it serves; the kernel's rows do not depend on the other rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F

from sgl_ext.gemm import MAX_M, GemmConfig, linear_small_m

_DTYPES = (torch.bfloat16, torch.float16)

# (N, K, M bucket) -> GemmConfig, from bench_gemm.py's "GEMM_CHOICES" lines (H100, bf16).
GEMM_CHOICES: dict[tuple[int, int, int], GemmConfig] = {}

_table: Mapping[tuple[int, int, int], GemmConfig] = GEMM_CHOICES


def m_bucket(m: int) -> int:
    """The table's M key: m rounded up to a power of two (m >= 1)."""
    return 1 << (m - 1).bit_length()


def choose_config(
    n: int, k: int, m: int, dtype: torch.dtype, device: torch.device
) -> GemmConfig | None:
    """The Triton configuration for a [m, k] x [n, k]^T linear, or None for F.linear."""
    if not _table or device.type != "cuda" or dtype not in _DTYPES or not 1 <= m <= MAX_M:
        return None
    return _table.get((n, k, m_bucket(m)))


def dispatch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the skinny Triton GEMM where the table says so.

    Parameters
    ----------
    x : [..., K] model dtype; weight : [N, K]; bias : [N] or None.

    Returns
    -------
    [..., N], x's dtype.
    """
    if _table and x.is_cuda and not torch.compiler.is_compiling():
        n, k = weight.shape
        cfg = choose_config(n, k, x.numel() // k if k else 0, x.dtype, x.device)
        if cfg is not None and weight.dtype == x.dtype:
            return linear_small_m(x, weight, bias, cfg)
    return F.linear(x, weight, bias)


@contextlib.contextmanager
def use_gemm_choices(table: Mapping[tuple[int, int, int], GemmConfig]) -> Iterator[None]:
    """Replace the table for a `with` block (tests, benchmarks): {(N, K, M bucket): config}."""
    global _table
    for key, cfg in table.items():
        if len(key) != 3 or m_bucket(key[2]) != key[2] or not isinstance(cfg, GemmConfig):
            raise ValueError(f"table entry {key}: {cfg!r} is not (N, K, pow2 M) -> GemmConfig")
    before, _table = _table, table  # the caller's mapping (tests may pass a catch-all)
    try:
        yield
    finally:
        _table = before

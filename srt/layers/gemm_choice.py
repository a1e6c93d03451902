"""Which kernel runs a decode linear: F.linear (cuBLAS) or sgl_ext's skinny Triton GEMM.

One table, sgl_ext/tables/gemm.json (`GEMM_CHOICES`), maps (N, K, M bucket) of a linear - its
local weight [N, K] and the token count rounded up to a power of two (1, 2, 4, ..., 64) - to the
Triton launch configuration that `benchmarks/bench_gemm.py` measured faster than F.linear on
the H100 (it prints the rows to paste there). Its `devices` rows (`DEVICE_OVERRIDES`) replace
rows on a GPU (by name) where another choice measured better end to end. A call whose key is
absent, or that is not on CUDA, not bf16/fp16, has more than 64 rows, or is traced by
torch.compile, runs F.linear.

Graph and eager agree bit for bit: the key depends only on the weight's shape and the M bucket,
and a CUDA-graph bucket of the runner (1, 2, 4, 8, then multiples of 8) has the same power-of-two
bucket as every batch size it serves; the kernel's rows do not depend on the other rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch

from sgl_ext import launch_tables
from sgl_ext.gemm import MAX_M, GemmConfig, linear_small_m, linear_small_m_native
from sgl_ext.launch import next_pow2

_DTYPES = (torch.bfloat16, torch.float16)
_is_compiling = torch.compiler.is_compiling


_KERNELS = ("fma", "dot", "f_linear")
_SIZES = ("block_n", "block_k", "num_warps", "num_stages")
Key = tuple[int, int, int]


def _row(row: dict) -> tuple[Key, GemmConfig | None]:
    """A gemm.json row: n, k, m, kernel (fma: broadcast multiply + sum, dot: swap-AB
    tensor-core dot, f_linear: F.linear), then block_n, block_k, num_warps, num_stages and
    split_k (default 1) for the Triton kernels."""
    key = tuple(launch_tables.take(row, f, int) for f in ("n", "k", "m"))
    if min(key) < 1 or key[2] > MAX_M or m_bucket(key[2]) != key[2]:
        raise ValueError(f"n and k must be >= 1, m a power of two <= {MAX_M}")
    kernel = launch_tables.take(row, "kernel", str)
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(_KERNELS)}, got {kernel!r}")
    cfg = None
    if kernel != "f_linear":
        sizes = {f: launch_tables.take(row, f, int) for f in _SIZES}
        split_k = launch_tables.take(row, "split_k", int) if "split_k" in row else 1
        cfg = GemmConfig(**sizes, split_k=split_k, dot=kernel == "dot")
    launch_tables.no_more(row)
    return (key[0], key[1], key[2]), cfg


def _check(rows: tuple[tuple[Key, GemmConfig | None], ...], device: str | None) -> None:
    keys = [k for k, _ in rows]
    dup = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if dup is not None:
        raise ValueError(f"two rows for (n, k, m) = {dup}")
    if device is None and any(cfg is None for _, cfg in rows):
        raise ValueError("f_linear is for a GPU's own rows (a linear without a row runs F.linear)")


def gemm_table() -> launch_tables.LaunchTable[tuple[Key, GemmConfig | None]]:
    """sgl_ext/tables/gemm.json, loaded on first use."""
    return launch_tables.load("gemm", _row, _check)


def table_row(key: Key, cfg: GemmConfig | None) -> dict[str, object]:
    """The gemm.json row of (N, K, M bucket) -> cfg (None: F.linear)."""
    row: dict[str, object] = dict(zip(("n", "k", "m"), key, strict=True))
    if cfg is None:
        return {**row, "kernel": "f_linear"}
    row.update(kernel="dot" if cfg.dot else "fma", block_n=cfg.block_n, block_k=cfg.block_k)
    row.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return row if cfg.split_k == 1 else {**row, "split_k": cfg.split_k}


_views: tuple[object, Mapping[Key, GemmConfig], Mapping[str, Mapping[Key, GemmConfig | None]]]
_views = (None, {}, {})


def _shipped() -> tuple[Mapping[Key, GemmConfig], Mapping[str, Mapping[Key, GemmConfig | None]]]:
    """gemm.json as read-only mappings: its rows, and each GPU's own rows."""
    global _views
    table = gemm_table()
    if _views[0] is not table:
        rows = MappingProxyType(dict(table.rows))
        own = {sub: MappingProxyType(dict(r)) for sub, r in table.devices.items()}
        _views = (table, rows, MappingProxyType(own))  # type: ignore[assignment]
    return _views[1], _views[2]


def __getattr__(name: str) -> object:
    """GEMM_CHOICES (the H100's rows) and DEVICE_OVERRIDES (a GPU's own), from gemm.json."""
    if name == "GEMM_CHOICES":
        return _shipped()[0]
    if name == "DEVICE_OVERRIDES":
        return _shipped()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_table: Mapping[Key, GemmConfig] | None = None  # use_gemm_choices' table; None: gemm.json's
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
    table = _table if _table is not None else _shipped()[0]
    if not table or device.type != "cuda" or dtype not in _DTYPES or not 1 <= m <= MAX_M:
        return None
    key = (n, k, m_bucket(m))
    if _table is None and any(key in t for t in _shipped()[1].values()):
        for own_key, cfg in gemm_table().device_rows(device):  # this GPU's exceptions first
            if own_key == key:
                return cfg
    return table.get(key)


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
    if x.is_cuda and not _is_compiling():
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
    before = _table
    # the caller's mapping (tests may pass a catch-all); gemm.json's own keeps its GPU rows
    _table = None if table is _shipped()[0] else table
    _chosen.clear()
    try:
        yield
    finally:
        _table = before
        _chosen.clear()

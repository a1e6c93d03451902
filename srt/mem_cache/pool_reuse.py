"""Reusing a KV pool across runs, keyed by its FULL configuration.

Allocating a multi-GiB KV pool is slow, so engines keep one between runs. A pool may only be
reused for exactly the configuration it was built for: a key that drops any field (e.g. "is it
fp8" instead of which fp8 and which scales) hands a run a pool of the wrong shape or encoding.
`KVPoolConfig` is that key, a frozen dataclass of every field; `KVPoolCache.get` returns a cached
pool only for an equal key, and always zeroes it first so nothing of a previous run survives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from srt.mem_cache.memory_pool import KV_DTYPES, MHATokenToKVPool

ScaleKey = float | tuple[float, ...] | None


def _check_scale(name: str, s: object) -> None:
    vals = s if isinstance(s, tuple) else (s,)
    for v in vals:
        if v is None and not isinstance(s, tuple):
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name} must be None, a float or a tuple of floats, got {s!r}")
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} values must be finite and positive, got {s!r}")


@dataclass(frozen=True)
class KVPoolConfig:
    """Everything that determines what a KV pool holds and how.

    Attributes
    ----------
    size, page_size, head_num, head_dim, layer_num : int
        As in `MHATokenToKVPool`.
    kv_cache_dtype : torch.dtype
        Dtype of the cache (bf16/fp16/fp32/fp8).
    model_dtype : torch.dtype
        Dtype of the activations written into it.
    device : str
    v_head_dim : int or None (= head_dim)
    start_layer : int
    cross_layer_layout : bool
    k_scale, v_scale : None, float, or one float per layer
        The fp8 quantisation scales the cache contents are encoded with.
    """

    size: int
    page_size: int
    kv_cache_dtype: torch.dtype
    model_dtype: torch.dtype
    head_num: int
    head_dim: int
    layer_num: int
    device: str
    v_head_dim: int | None = None
    start_layer: int = 0
    cross_layer_layout: bool = False
    k_scale: ScaleKey = None
    v_scale: ScaleKey = None
    extra: tuple[tuple[str, object], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_DTYPES:
            raise TypeError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {self.kv_cache_dtype}")
        if not isinstance(self.model_dtype, torch.dtype) or not self.model_dtype.is_floating_point:
            raise TypeError(f"model_dtype must be a floating torch.dtype, got {self.model_dtype}")
        object.__setattr__(self, "device", str(torch.device(self.device)))
        _check_scale("k_scale", self.k_scale)
        _check_scale("v_scale", self.v_scale)
        for name in ("k_scale", "v_scale"):
            val = getattr(self, name)
            if isinstance(val, (int, float)) and not isinstance(val, bool):
                object.__setattr__(self, name, float(val))
        hash(self.extra)  # must be hashable (raises TypeError otherwise)

    def create_pool(self, alt_stream: torch.cuda.Stream | None = None) -> MHATokenToKVPool:
        return MHATokenToKVPool(
            self.size,
            self.page_size,
            self.kv_cache_dtype,
            self.head_num,
            self.head_dim,
            self.layer_num,
            self.device,
            v_head_dim=self.v_head_dim,
            start_layer=self.start_layer,
            cross_layer_layout=self.cross_layer_layout,
            alt_stream=alt_stream,
        )


class KVPoolCache:
    """Keeps up to `max_pools` pools, each reused only for an equal `KVPoolConfig`.

    Parameters
    ----------
    max_pools : int
        Pools kept at once; getting a new configuration evicts the least recently used one.
    """

    def __init__(self, max_pools: int = 1) -> None:
        if not isinstance(max_pools, int) or max_pools < 1:
            raise ValueError(f"max_pools must be a positive int, got {max_pools!r}")
        self.max_pools = max_pools
        self._pools: dict[KVPoolConfig, MHATokenToKVPool] = {}

    def get(
        self, config: KVPoolConfig, alt_stream: torch.cuda.Stream | None = None
    ) -> MHATokenToKVPool:
        """The pool for `config`: a cached one zeroed, or a new one (zero-initialised)."""
        if not isinstance(config, KVPoolConfig):
            raise TypeError(f"config must be a KVPoolConfig, got {type(config).__name__}")
        pool = self._pools.pop(config, None)
        if pool is None:
            while len(self._pools) >= self.max_pools:
                self._pools.pop(next(iter(self._pools)))  # evict least recently used
            pool = config.create_pool(alt_stream)
        else:
            pool.clear()  # nothing of the previous run survives
            pool.alt_stream = alt_stream
            pool.set_stream_overlap(False)
        self._pools[config] = pool  # most recently used last
        return pool

    def __len__(self) -> int:
        return len(self._pools)

    def __contains__(self, config: object) -> bool:
        return config in self._pools

    def clear(self) -> None:
        """Drop every cached pool (their memory is freed once no one else holds them)."""
        self._pools.clear()

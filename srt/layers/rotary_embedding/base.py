"""RotaryEmbedding: the rotary position embedding layer, optionally fused with the KV-cache write.

Follows SGLang's `srt/layers/rotary_embedding.py`: the layer owns a float32 `cos_sin_cache`
[max_position, rotary_dim] (cos in the first half of each row, sin in the second) and
`forward(positions, query, key, offsets=None, fused_set_kv_buffer_arg=None)` rotates query and
key in place and returns them. With a `FusedSetKVBufferArg`, the rotated K and the V are also
stored into the layer's KV cache by the same `sgl_ext` kernel: every forward of every variant
honours the argument (none drops it).
"""

from __future__ import annotations

import torch
from torch import nn

import sgl_ext
from sgl_ext import FusedSetKVBufferArg
from sgl_ext.launch import check_fused_arg
from sgl_ext.native import rotate_native  # the op's torch reference (fp32 math, in place)


def _check_dims(head_size: int, rotary_dim: int, max_position_embeddings: int) -> None:
    for name, x in (
        ("head_size", head_size),
        ("rotary_dim", rotary_dim),
        ("max_position_embeddings", max_position_embeddings),
    ):
        if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head_size {head_size}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), neox (rotate halves) or GPT-J (interleaved) style.

    Parameters
    ----------
    head_size : int
        D, the size of each query/key head.
    rotary_dim : int
        Leading dims of each head that are rotated (even, <= head_size); the rest pass through
        (partial rotary).
    max_position_embeddings : int
        Positions covered by the cache (`ensure_cos_sin_cache_length` can extend it).
    base : float
        RoPE theta.
    is_neox_style : bool
        True: rotate the two halves of the rotary dims; False: rotate interleaved pairs (GPT-J).
    dtype : torch.dtype
        The activation dtype (kept for SGLang compatibility; the cache itself is float32).
    """

    cos_sin_cache: torch.Tensor  # float32 [num_positions, rotary_dim], a non-persistent buffer

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        _check_dims(head_size, rotary_dim, max_position_embeddings)
        if not base > 0:
            raise ValueError(f"base must be positive, got {base!r}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.base = float(base)
        self.is_neox_style = bool(is_neox_style)
        self.dtype = dtype
        self._device_caches: dict[torch.device, torch.Tensor] = {}
        self._retired_caches: list[torch.Tensor] = []
        self.num_positions = self._default_num_positions()  # rows of the table
        self.register_buffer("cos_sin_cache", self._build_cache(), persistent=False)

    # ------------------------------------------------------------------ cache
    def _default_num_positions(self) -> int:
        """Rows of the table as built: max_position_embeddings (scaled variants: more)."""
        return self.max_position_embeddings

    def _can_grow(self) -> bool:
        """Whether row t of the table depends on t alone (so more rows can be appended)."""
        return True

    def ensure_cos_sin_cache_length(self, num_positions: int) -> None:
        """Make the table cover positions 0 .. num_positions - 1 (grow it, never shrink it).

        The new table is computed by the same formula, so the existing rows keep their values
        (what a layer built with a larger max_position would hold). Call it at construction,
        before any CUDA graph captures the table.

        Parameters
        ----------
        num_positions : int
            Positions that must be served (the context length).

        Raises
        ------
        ValueError
            If the table is shorter and this variant cannot grow it (several linear factors,
            whose rows are laid out by offset); the message names both numbers.
        """
        if not isinstance(num_positions, int) or isinstance(num_positions, bool):
            raise TypeError(f"num_positions must be an int, got {num_positions!r}")
        rows = self.cos_sin_cache.shape[0]
        if num_positions <= rows:
            return
        if not self._can_grow():
            raise ValueError(
                f"context length {num_positions} exceeds the {rows}-row rope table of"
                f" {type(self).__name__}, which cannot grow; lower context_length to {rows}"
            )
        self.num_positions = num_positions
        # get_rope shares instances between models: keep the old tables alive, since a CUDA
        # graph of another model may have captured their addresses.
        self._retired_caches += [self.cos_sin_cache, *self._device_caches.values()]
        self.cos_sin_cache = self._build_cache(self.cos_sin_cache.device)
        self._device_caches.clear()

    def _compute_inv_freq(self, base: float) -> torch.Tensor:
        """float64 [rotary_dim / 2] inverse frequencies base^(-2i / rotary_dim)."""
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
        return 1.0 / (base**exps)

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        """float64 [num_positions, rotary_dim]: cos | sin of position * inv_freq."""
        inv_freq = self._compute_inv_freq(self.base)  # [rot/2]
        t = torch.arange(self.num_positions, dtype=torch.float64)  # [num_positions]
        freqs = torch.outer(t, inv_freq)  # [num_positions, rot/2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def _build_cache(self, device: torch.device | None = None) -> torch.Tensor:
        # Computed in float64 on the CPU, stored as float32 on `device` (default: the default).
        with torch.device("cpu"):
            cache = self._compute_cos_sin_cache()
        target = torch.get_default_device() if device is None else device
        return cache.to(torch.float32).to(target).contiguous()

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        """Keep the cache float32 when the module is cast (model.to(torch.bfloat16))."""
        super()._apply(fn, recurse)
        if self.cos_sin_cache.dtype != torch.float32:
            self.cos_sin_cache = self._build_cache(self.cos_sin_cache.device)
        self._device_caches.clear()
        return self

    def _cache_for(self, device: torch.device) -> torch.Tensor:
        """The float32 cache on `device` (a memoised copy if the module lives elsewhere)."""
        if self.cos_sin_cache.device == device:
            return self.cos_sin_cache
        cache = self._device_caches.get(device)
        if cache is None:
            cache = self._device_caches[device] = self.cos_sin_cache.to(device)
        return cache

    # ------------------------------------------------------------------ forward
    @staticmethod
    def _positions(positions: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if offsets is not None:
            positions = positions + offsets
        return positions.reshape(-1)  # [T]

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        offsets: torch.Tensor | None = None,
        fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query and key in place (and store K/V into the cache if asked).

        Parameters
        ----------
        positions : int32/int64 [T]
        query : bf16/fp16/fp32 [T, Hq*D] or [T, Hq, D], may be a strided view (last dim
            contiguous) of a fused qkv output.
        key : [T, Hkv*D] or [T, Hkv, D], dtype of query.
        offsets : int [T], optional
            Added to positions.
        fused_set_kv_buffer_arg : FusedSetKVBufferArg, optional
            The rotated K and `value` are written to `k_buffer`/`v_buffer` at `cache_loc`.

        Returns
        -------
        (query, key), the same tensors, rotated.

        The `sgl_ext` op picks its backend by device (Triton on CUDA, torch-native on CPU;
        `SGL_EXT_BACKEND` forces one), so this path serves every device.
        """
        return self.forward_cuda(positions, query, key, offsets, fused_set_kv_buffer_arg)

    def forward_cuda(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        offsets: torch.Tensor | None = None,
        fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel path: one sgl_ext launch rotates q/k and (fused) writes the KV cache."""
        pos = self._positions(positions, offsets)
        sgl_ext.apply_rope_with_cos_sin_cache_inplace(
            pos,
            query,
            key,
            self.head_size,
            self._cache_for(query.device),
            is_neox=self.is_neox_style,
            fused_set_kv_buffer_arg=fused_set_kv_buffer_arg,
        )
        return query, key

    def forward_native(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        offsets: torch.Tensor | None = None,
        fused_set_kv_buffer_arg: FusedSetKVBufferArg | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain-torch rotation (in place, computed in fp32), then the cache write if asked.

        The fused argument is honoured with `sgl_ext.set_kv_buffer` (same stored bits as the
        fused kernel), never dropped.
        """
        pos = self._positions(positions, offsets)
        if pos.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"positions must be int32/int64, got {pos.dtype}")
        cache = self._cache_for(query.device)
        for name, x in (("query", query), ("key", key)):
            if not isinstance(x, torch.Tensor) or x.ndim not in (2, 3):
                raise ValueError(f"{name} must be a 2-D [T, H*D] or 3-D [T, H, D] tensor")
            if x.shape[-1] % self.head_size or (x.ndim == 3 and x.shape[-1] != self.head_size):
                raise ValueError(
                    f"{name} last dim {x.shape[-1]} does not fit head_size {self.head_size}"
                )
            if x.shape[0] != pos.shape[0]:
                raise ValueError(f"{name} has {x.shape[0]} tokens, positions {pos.shape[0]}")
        a = fused_set_kv_buffer_arg
        if a is not None:  # reject a bad cache argument before touching query/key
            check_fused_arg(key, a, self.head_size)
        rotate_native(pos, query, self.head_size, cache, self.is_neox_style)
        rotate_native(pos, key, self.head_size, cache, self.is_neox_style)
        if a is not None:
            sgl_ext.set_kv_buffer(
                key,
                a.value,
                a.k_buffer,
                a.v_buffer,
                a.cache_loc,
                a.k_scale,
                a.v_scale,
                head_size=self.head_size,
            )
        return query, key

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position_embeddings={self.max_position_embeddings}, base={self.base}, "
            f"is_neox_style={self.is_neox_style}"
        )

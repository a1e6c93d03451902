"""Memory pools: request -> token slots (`ReqToTokenPool`), token slot -> K/V (`MHATokenToKVPool`).

Names and signatures follow SGLang's `srt/mem_cache/memory_pool.py`. The KV pool owns zeroed
buffers of `size + page_size` slots: slot (page) 0 is the padding slot that padded CUDA-graph
tokens may write and that no request ever reads; the allocators never hand it out.

This module never imports layers, models or the graph runner: whether K and V may be written on
two streams is told to the pool by the runner (`set_stream_overlap`), never looked up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch

import sgl_ext

if TYPE_CHECKING:
    from srt.mem_cache.scrub import SlotTable
from sgl_ext import FP8_DTYPES, INPUT_DTYPES
from sgl_ext.kv_cache import alias_check as kv_alias_check
from sgl_ext.launch import check_kv_write, kv_layout
from sgl_ext.native import quantize_native, scatter_native
from srt.mem_cache.host_copy import upload

KV_DTYPES = (*INPUT_DTYPES, *FP8_DTYPES)  # bf16, fp16, fp32, fp8 e4m3 / e5m2
Scale = float | torch.Tensor | None


def slot_index(buf: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The index tuple addressing `slots` (int64, any shape) in one layer's K or V buffer:
    `(slots,)` for [slots, H, D], `(slots // page_size, slots % page_size)` for
    [pages, page_size, H, D]. Strided views are indexed in place, never copied."""
    if buf.ndim == 4:
        ps = buf.shape[1]
        return (slots // ps, slots % ps)
    if buf.ndim == 3:
        return (slots,)
    raise ValueError(
        f"KV buffer must be [slots, H, D] or [pages, page_size, H, D], got {buf.ndim}-D"
    )


def _positive_int(name: str, x: object) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return x


def _request_rows(free_index: object) -> list[int]:
    """`free_index` as a list of Python ints (TypeError for anything but ints and int
    tensors: a tensor element or a float kept as-is would never match a free row)."""
    if isinstance(free_index, torch.Tensor):
        if free_index.dtype not in (torch.int32, torch.int64) or free_index.ndim > 1:
            raise TypeError(
                "free_index must be an int, a list of ints or an int32/int64 tensor of at most"
                f" 1 dim, got a {free_index.dtype} tensor of shape {tuple(free_index.shape)}"
            )
        return [int(i) for i in free_index.reshape(-1).tolist()]
    items = [free_index] if not isinstance(free_index, (list, tuple)) else list(free_index)
    for i in items:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(
                "free_index must be an int, a list of ints or an int32/int64 tensor, got"
                f" {type(i).__name__} {i!r}"
            )
    return cast("list[int]", items)


class ReqToTokenPool:
    """Maps a request slot to the KV slots of its tokens.

    Parameters
    ----------
    size : int
        Number of concurrent requests.
    max_context_len : int
        Longest sequence a request may hold.
    device : str or torch.device
    enable_swa : bool
        Also keep `req_to_swa_token` (for a hybrid `SWAKVPool`).

    Attributes
    ----------
    req_to_token : int32 [size, max_context_len]
        Row r, column i: the KV slot of token i of the request in slot r (0 = unset/padding).
    req_to_swa_token : int32 [size, max_context_len] or None
        The same for the sliding-window layers' pool: the token's window slot. Entries of
        tokens that left the window are stale; attention never reads them (they are outside
        every query's window).
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device,
        *,
        enable_swa: bool = False,
    ) -> None:
        self.size = _positive_int("size", size)
        self.max_context_len = _positive_int("max_context_len", max_context_len)
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int32, device=self.device
        )  # [size, max_context_len]
        self.req_to_swa_token = (
            torch.zeros_like(self.req_to_token) if enable_swa else None
        )  # [size, max_context_len]
        self.free_slots: list[int] = list(range(size))

    def write(self, indices: torch.Tensor | int | slice, values: torch.Tensor) -> None:
        """req_to_token[indices] = values (SGLang's helper)."""
        self.req_to_token[indices] = values

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        """Take `need_size` request slots; None if not enough are free."""
        if not isinstance(need_size, int) or isinstance(need_size, bool) or need_size < 0:
            raise ValueError(f"need_size must be a non-negative int, got {need_size!r}")
        if need_size > len(self.free_slots):
            return None
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select

    def free(self, free_index: int | list[int] | torch.Tensor) -> None:
        """Return request slots; their rows are reset to 0 (padding) so no stale slot survives.

        Parameters
        ----------
        free_index : int, list/tuple of ints, or an int32/int64 tensor of 0 or 1 dims
            The rows to return (a device tensor is read on the host: a synchronisation).

        Raises
        ------
        TypeError
            Anything else (a float, a bool, a float tensor, ...).
        ValueError
            A row out of range, already free, or listed twice; nothing is freed then.
        """
        idx = _request_rows(free_index)
        free_set = set(self.free_slots)
        for i in idx:
            if not 0 <= i < self.size:
                raise ValueError(f"free_index: request slot {i} out of range [0, {self.size})")
            if i in free_set:
                raise ValueError(f"free_index: request slot {i} freed twice")
            free_set.add(i)
        if idx:  # index_fill_ of uploaded rows: no host wait (a step may still run)
            rows = upload(torch.tensor(idx, dtype=torch.int64), self.req_to_token.device)
            self.req_to_token.index_fill_(0, rows, 0)
            if self.req_to_swa_token is not None:
                self.req_to_swa_token.index_fill_(0, rows, 0)
        self.free_slots.extend(idx)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
        self.req_to_token.zero_()
        if self.req_to_swa_token is not None:
            self.req_to_swa_token.zero_()


@dataclass(frozen=True)
class KVCacheLayout:
    """How a pool's K/V bytes are laid out, for transfer code that uses raw pointers.

    kind : "layer_separate" (one K and one V allocation per layer, each `shape`) or "cross_layer"
        (a single allocation of `shape` with `dims` = (pages, layers, kv, page_size, heads,
        head_dim); kv index 0 is K and 1 is V).
    shape : physical shape of each allocation, in `store_dtype` elements, C-contiguous.
    dims : name of each dim of `shape`.
    """

    kind: str
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    store_dtype: torch.dtype
    dtype: torch.dtype
    page_size: int
    num_pages: int
    layer_num: int
    start_layer: int


class _HasLayerId(Protocol):
    layer_id: int


class MHATokenToKVPool:
    """The K and V caches of every layer of a multi-head-attention model.

    Parameters
    ----------
    size : int
        Usable token slots, a multiple of page_size. The buffers hold size + page_size slots;
        slot (page) 0 is padding.
    page_size : int
        Tokens per page (>= 1).
    dtype : torch.dtype
        The KV-cache dtype: bfloat16, float16, float32, float8_e4m3fn or float8_e5m2. fp8 is stored
        as uint8 (`store_dtype`); the getters return fp8 views.
    head_num, head_dim : int
        KV heads and K head size; `v_head_dim` (default head_dim) is the V head size.
    layer_num : int
        Layers held, with ids start_layer .. start_layer + layer_num - 1.
    device : str or torch.device
    cross_layer_layout : bool
        One allocation [pages, layers, 2, page_size, H, D] (needs v_head_dim == head_dim) with
        strided per-layer views, instead of one K and one V buffer per layer.
    alt_stream : torch.cuda.Stream, optional
        Used for the V write under CUDA-graph capture once `set_stream_overlap(True)`.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device,
        *,
        v_head_dim: int | None = None,
        start_layer: int = 0,
        cross_layer_layout: bool = False,
        alt_stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.size = _positive_int("size", size)
        self.page_size = _positive_int("page_size", page_size)
        if size % page_size:
            raise ValueError(f"size {size} must be a multiple of page_size {page_size}")
        if dtype not in KV_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in KV_DTYPES)
            raise TypeError(f"dtype (the KV-cache dtype) must be one of ({names}), got {dtype}")
        self.head_num = _positive_int("head_num", head_num)
        self.head_dim = _positive_int("head_dim", head_dim)
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.v_head_dim = _positive_int("v_head_dim", v_head_dim)
        self.layer_num = _positive_int("layer_num", layer_num)
        if not isinstance(start_layer, int) or start_layer < 0:
            raise ValueError(f"start_layer must be a non-negative int, got {start_layer!r}")
        if cross_layer_layout and self.v_head_dim != self.head_dim:
            raise ValueError("cross_layer_layout needs v_head_dim == head_dim")
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype in FP8_DTYPES else dtype
        self.device = torch.device(device)
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num - 1
        self.cross_layer_layout = bool(cross_layer_layout)
        self.alt_stream = alt_stream
        self._stream_overlap = False
        self.num_pages = size // page_size + 1  # page 0 is the padding page
        self.num_slots = self.num_pages * page_size  # = size + page_size
        self._slot_table: object = None  # zero_slots' device table (built on first use)
        self._create_buffers()

    # ------------------------------------------------------------------ buffers
    def _create_buffers(self) -> None:
        p, ps, h, L = self.num_pages, self.page_size, self.head_num, self.layer_num
        zeros = lambda *shape: torch.zeros(shape, dtype=self.store_dtype, device=self.device)
        if self.cross_layer_layout:
            self.kv_buffer: torch.Tensor | None = zeros(p, L, 2, ps, h, self.head_dim)
            # kv_buffer: [pages, L, 2, ps, H, D]
            # buf[:, l, 0] -> [pages, ps, H, D] strided; for ps == 1 also drop the ps dim
            sel = (lambda t: t[:, :, :, 0]) if ps == 1 else (lambda t: t)
            kv = sel(self.kv_buffer)  # [pages, L, 2, (ps,) H, D]
            self.k_buffer = [kv[:, i, 0] for i in range(L)]
            self.v_buffer = [kv[:, i, 1] for i in range(L)]
            return
        self.kv_buffer = None
        slot_shape = (self.num_slots,) if ps == 1 else (p, ps)
        self.k_buffer = [zeros(*slot_shape, h, self.head_dim) for _ in range(L)]  # [.., H, D]
        self.v_buffer = [zeros(*slot_shape, h, self.v_head_dim) for _ in range(L)]  # [.., H, Dv]

    def get_layout(self) -> KVCacheLayout:
        """Description of the physical layout (see `KVCacheLayout`)."""
        if self.cross_layer_layout:
            assert self.kv_buffer is not None
            shape = tuple(self.kv_buffer.shape)
            dims: tuple[str, ...] = ("pages", "layers", "kv", "page_size", "heads", "head_dim")
            kind = "cross_layer"
        else:
            shape = tuple(self.k_buffer[0].shape)
            dims = (("slots",) if self.page_size == 1 else ("pages", "page_size")) + (
                "heads",
                "head_dim",
            )
            kind = "layer_separate"
        return KVCacheLayout(
            kind,
            shape,
            dims,
            self.store_dtype,
            self.dtype,
            self.page_size,
            self.num_pages,
            self.layer_num,
            self.start_layer,
        )

    def _index(self, layer_id: object) -> int:
        if not isinstance(layer_id, int) or isinstance(layer_id, bool):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        if not self.start_layer <= layer_id <= self.end_layer:
            raise ValueError(
                f"layer_id {layer_id} out of range [{self.start_layer}, {self.end_layer}]"
            )
        return layer_id - self.start_layer

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K cache of a layer: [slots, H, D] (page_size 1) or [pages, page_size, H, D], `dtype`."""
        return self._view(self.k_buffer[self._index(layer_id)])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V cache of a layer: [slots, H, Dv] (page_size 1) or [pages, page_size, H, Dv]."""
        return self._view(self.v_buffer[self._index(layer_id)])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    # ------------------------------------------------------------------ writes
    def set_stream_overlap(self, enabled: bool) -> None:
        """Set by the runner: under CUDA-graph capture, write V on `alt_stream` overlapping K."""
        self._stream_overlap = bool(enabled)

    def _overlap_active(self, device: torch.device) -> bool:
        return (
            self._stream_overlap
            and self.alt_stream is not None
            and device.type == "cuda"
            and torch.cuda.is_current_stream_capturing()
        )

    def set_kv_buffer(
        self,
        layer: _HasLayerId,
        loc: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: Scale = None,
        v_scale: Scale = None,
        layer_id_override: int | None = None,
    ) -> None:
        """Store K and V of T tokens into the slots `loc` of one layer (the unfused write).

        Parameters
        ----------
        layer : object with `.layer_id`
        loc : int32/int64 [T]
            Slot per token; slot < 0 is not written (padding).
        cache_k : [T, H, D] or [T, H*D]; cache_v : [T, H, Dv] or [T, H*Dv]
            bf16/fp16/fp32; must equal `dtype` unless the pool is fp8. Never modified.
        k_scale, v_scale : None, positive float or 1-element tensor
            fp8 pools store saturate(x * (1 / scale)); ignored by non-fp8 pools (as in SGLang).
        """
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        idx = self._index(layer_id)
        for name, t in (("loc", loc), ("cache_k", cache_k), ("cache_v", cache_v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if loc.ndim != 1 or loc.shape[0] != cache_k.shape[0] or loc.shape[0] != cache_v.shape[0]:
            raise ValueError(
                f"loc must be 1-D with one slot per token: loc {tuple(loc.shape)}, cache_k"
                f" {tuple(cache_k.shape)}, cache_v {tuple(cache_v.shape)}"
            )
        if self.dtype not in FP8_DTYPES:
            if cache_k.dtype != self.dtype or cache_v.dtype != self.dtype:
                raise TypeError(
                    f"cache_k/cache_v dtype {cache_k.dtype}/{cache_v.dtype} must equal the pool"
                    f" dtype {self.dtype}"
                )
            k_scale = v_scale = None
        k_buf, v_buf = self._view(self.k_buffer[idx]), self._view(self.v_buffer[idx])
        if self._overlap_active(cache_k.device):
            self._set_kv_overlapped(idx, k_buf, v_buf, loc, cache_k, cache_v, k_scale, v_scale)
            return
        sgl_ext.set_kv_buffer(
            cache_k, cache_v, k_buf, v_buf, loc, k_scale, v_scale, head_size=self.head_dim
        )

    def _set_kv_overlapped(self, idx, k_buf, v_buf, loc, cache_k, cache_v, k_scale, v_scale):
        """K on the current stream, V on alt_stream; events join the streams both ways."""
        # Same checks as the single-kernel path (metadata, aliasing), before anything is enqueued.
        check_kv_write(
            cache_k, cache_v, k_buf, v_buf, loc, k_scale, v_scale, cache_k.shape[0], self.head_dim
        )
        kv_alias_check(cache_k, cache_v, k_buf, v_buf, loc, k_scale, v_scale)
        cur = torch.cuda.current_stream(cache_k.device)
        alt = self.alt_stream
        assert alt is not None
        ready = torch.cuda.Event()
        ready.record(cur)  # K, V and loc are produced on the current stream
        alt.wait_event(ready)
        k_rows = cache_k.reshape(cache_k.shape[0], self.head_num, self.head_dim)  # [T, H, D]
        v_rows = cache_v.reshape(cache_v.shape[0], self.head_num, self.v_head_dim)  # [T, H, Dv]
        self._scatter_rows(self.k_buffer[idx], loc, k_rows, k_scale)
        with torch.cuda.stream(alt):
            self._scatter_rows(self.v_buffer[idx], loc, v_rows, v_scale)
            done = torch.cuda.Event()
            done.record(alt)
        # Readers on the current stream see V; and since every later op on the current stream
        # is ordered after alt's work, the caller's tensors read on alt may be freed safely.
        cur.wait_event(done)

    def _scatter_rows(
        self, store: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, scale: Scale
    ) -> None:
        """store[slot loc[i]] = quantised rows[i] with sgl_ext's sync-free torch-native write.

        store: a raw buffer (store_dtype) [slots, H, D] or [pages, ps, H, D]; rows [T, H, D].
        Tokens with loc < 0 (or out of range) are not written (same bits as the kernels).
        """
        buf = store.view(self.dtype)  # the fp8 view of uint8 storage; a no-op otherwise
        lay = kv_layout("kv buffer", buf, buf.shape[-2], buf.shape[-1])
        scatter_native(buf, lay, loc, quantize_native(rows, buf.dtype, scale))

    # ------------------------------------------------------------------ hygiene
    def zero_slots(self, indices: torch.Tensor) -> None:
        """Zero K and V of the given slots in every layer (scrub before a new request).

        Parameters
        ----------
        indices : int32/int64 tensor, any shape, on the host or the pool's device
            Slots to zero. Entries < 0 or >= `num_slots` are skipped, as the KV write skips a
            slot < 0 (padding): on the host they are dropped; on the device they are zeroed as
            padding slot 0 instead (no request reads it), which needs no synchronisation.
        """
        if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(
                f"indices must be an int32/int64 tensor, got {getattr(indices, 'dtype', None)}"
                f" {type(indices).__name__}"
            )
        idx = indices.reshape(-1)
        if idx.device.type == "cpu":
            idx = idx[(idx >= 0) & (idx < self.num_slots)]
        idx = upload(idx, self.device, torch.int64)  # no host wait
        if idx.numel() == 0:
            return
        if indices.device.type != "cpu":
            idx = torch.where((idx >= 0) & (idx < self.num_slots), idx, 0)
        table = self.scrub_table()
        if table is not None:  # one launch for every layer (the allocator scrubs every step)
            from srt.mem_cache.scrub import zero_slots_all

            zero_slots_all(table, idx)
            return
        for kb, vb in zip(self.k_buffer, self.v_buffer, strict=True):
            for b in (kb, vb):
                b[slot_index(b, idx)] = 0

    def scrub_table(self) -> SlotTable | None:
        """The device table that zeroes slots of every layer's K and V in one launch (CUDA,
        buffers of one slot stride; built on first use), or None (index them one by one)."""
        if self.device.type != "cuda" or self.kv_buffer is not None:
            return None
        if self._slot_table is None:  # False: the buffers do not fit the kernel
            from srt.mem_cache.scrub import slot_table

            self._slot_table = slot_table(self.k_buffer + self.v_buffer) or False
        return cast("SlotTable | None", self._slot_table or None)

    def clear(self) -> None:
        """Zero every K and V byte (so nothing survives into the next user's requests)."""
        if self.kv_buffer is not None:
            self.kv_buffer.zero_()
            return
        for b in self.k_buffer + self.v_buffer:
            b.zero_()

    def get_kv_size_bytes(self) -> tuple[int, int]:
        k = sum(b.numel() * b.element_size() for b in self.k_buffer)
        v = sum(b.numel() * b.element_size() for b in self.v_buffer)
        return k, v

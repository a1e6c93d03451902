"""SWAKVPool: the hybrid KV pool of models that mix full and sliding-window attention layers.

Named after SGLang's `SWAKVPool`. Full-attention layers keep a KV slot for every token of every
request (`full_kv_pool`, an `MHATokenToKVPool` over the full layers only). Sliding-window layers
only ever read the last `sliding_window_size + 1` tokens of a request, so they get a separate,
much smaller pool (`swa_kv_pool`) with its own allocator; a token's window slot is freed as soon
as the token leaves the window.

Tokens are named by their *full* slot everywhere (req_to_token, out_cache_loc). The per-token
mapping `full_to_swa_index_mapping[full_slot]` gives the token's window slot, or -1 when it has
none (never given one, or already left the window). Slot (page) 0 of both pools is padding, and
full slot 0 maps to window slot 0, so padded CUDA-graph rows write only padding slots.

* Writes: `set_kv_buffer` (unfused) takes full slots and translates them for window layers;
  the fused RoPE + KV op gets `translate_loc_from_full_to_swa(out_cache_loc)` as its cache_loc
  for window layers (computed on the device: no host sync, capturable in CUDA graphs).
* Reads: `get_key_buffer` / `get_value_buffer` return the window pool's buffers for window
  layers; attention indexes them through `ReqToTokenPool.req_to_swa_token` (the window slot of
  each request's tokens) instead of `req_to_token`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from srt.mem_cache.host_copy import upload
from srt.mem_cache.memory_pool import MHATokenToKVPool, Scale, _HasLayerId

if TYPE_CHECKING:
    from srt.mem_cache.scrub import SlotTable


class SWAKVPool:
    """Full layers in one MHATokenToKVPool, sliding-window layers in a smaller one.

    Parameters
    ----------
    size : int
        Usable full slots (a multiple of page_size): tokens of all requests together.
    size_swa : int
        Usable window slots (a multiple of page_size).
    page_size : int
    dtype : torch.dtype
        KV-cache dtype (as MHATokenToKVPool).
    head_num, head_dim : int
        KV heads and K head size of every layer; `v_head_dim` defaults to head_dim.
    swa_attention_layer_ids, full_attention_layer_ids : sequences of int
        The model's layer ids by kind; together they must be 0 .. layer_num - 1, each once.
    sliding_window_size : int
        The largest window-left W of the window layers (a query at position p reads p - W .. p).
    device : str or torch.device
    alt_stream : torch.cuda.Stream, optional
        Given to both pools (V written on it under CUDA-graph capture).
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        swa_attention_layer_ids: Sequence[int],
        full_attention_layer_ids: Sequence[int],
        sliding_window_size: int,
        device: str | torch.device,
        *,
        v_head_dim: int | None = None,
        alt_stream: torch.cuda.Stream | None = None,
    ) -> None:
        swa_ids, full_ids = list(swa_attention_layer_ids), list(full_attention_layer_ids)
        if not swa_ids or not full_ids:
            raise ValueError("SWAKVPool needs at least one sliding-window and one full layer")
        if sorted(swa_ids + full_ids) != list(range(len(swa_ids) + len(full_ids))):
            raise ValueError(f"layer ids must cover 0 .. n-1 once: swa {swa_ids}, full {full_ids}")
        if not isinstance(sliding_window_size, int) or sliding_window_size < 1:
            raise ValueError(f"sliding_window_size must be an int >= 1, got {sliding_window_size}")
        self.full_kv_pool = MHATokenToKVPool(
            size,
            page_size,
            dtype,
            head_num,
            head_dim,
            len(full_ids),
            device,
            v_head_dim=v_head_dim,
            alt_stream=alt_stream,
        )
        self.swa_kv_pool = MHATokenToKVPool(
            size_swa,
            page_size,
            dtype,
            head_num,
            head_dim,
            len(swa_ids),
            device,
            v_head_dim=v_head_dim,
            alt_stream=alt_stream,
        )
        self.size, self.size_swa = size, size_swa
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = self.full_kv_pool.store_dtype
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = self.full_kv_pool.v_head_dim
        self.layer_num = len(swa_ids) + len(full_ids)
        self.start_layer, self.end_layer = 0, self.layer_num - 1
        self.device = torch.device(device)
        self.sliding_window_size = sliding_window_size
        self.swa_attention_layer_ids = tuple(swa_ids)
        self.full_attention_layer_ids = tuple(full_ids)
        # layer id -> (index inside its pool, is a window layer)
        self.layers_mapping: dict[int, tuple[int, bool]] = {
            **{lid: (i, False) for i, lid in enumerate(full_ids)},
            **{lid: (i, True) for i, lid in enumerate(swa_ids)},
        }
        # int64 [full slots]: window slot of each full slot, -1 = none; padding page -> padding.
        self.full_to_swa_index_mapping = torch.full(
            (self.full_kv_pool.num_slots,), -1, dtype=torch.int64, device=self.device
        )
        self._reset_padding()
        # The overlapped decode (Scheduler) sets this: window evictions' mapping resets then
        # wait on the host until the next decode step's table kernel applies them
        # (`take_mapping_resets`) or any other mapping access here flushes them first.
        self.defer_mapping_resets = False
        self._pending_resets: list[torch.Tensor] = []

    def _reset_padding(self) -> None:
        ps = self.page_size
        self.full_to_swa_index_mapping[:ps] = torch.arange(ps, device=self.device)

    # ------------------------------------------------------------------ layers
    def _layer(self, layer_id: object) -> tuple[MHATokenToKVPool, int, bool]:
        if not isinstance(layer_id, int) or isinstance(layer_id, bool):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        hit = self.layers_mapping.get(layer_id)
        if hit is None:
            raise ValueError(f"layer_id {layer_id} out of range [0, {self.end_layer}]")
        idx, swa = hit
        return (self.swa_kv_pool if swa else self.full_kv_pool), idx, swa

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether the layer's K/V live in the window pool (indexed by window slots)."""
        return self._layer(layer_id)[2]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K cache of a layer in its own pool: [slots, H, D] or [pages, page_size, H, D]."""
        pool, idx, _ = self._layer(layer_id)
        return pool.get_key_buffer(idx)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V cache of a layer in its own pool: [slots, H, Dv] or [pages, page_size, H, Dv]."""
        pool, idx, _ = self._layer(layer_id)
        return pool.get_value_buffer(idx)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    # ------------------------------------------------------------------ mapping
    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """int64 [T] window slot of each full slot `loc` (int32/int64 [T]); -1 where loc < 0 or
        the token has no window slot. A device gather: no sync, capturable in CUDA graphs."""
        self.flush_mapping_resets()
        loc = loc.long()
        swa = self.full_to_swa_index_mapping[loc.clamp(min=0)]  # [T]
        return torch.where(loc < 0, -1, swa)

    def set_swa_mapping(self, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> None:
        """Record that the tokens in full slots `full_slots` [n] have window slots `swa_slots`
        [n] (host or device int tensors; host ones are copied once, without a sync)."""
        self.flush_mapping_resets()
        full = upload(full_slots, self.device, torch.int64)
        swa = upload(swa_slots, self.device, torch.int64)
        self.full_to_swa_index_mapping[full] = swa

    def reset_swa_mapping(self, full_slots: torch.Tensor) -> None:
        """The tokens in `full_slots` [n] no longer have a window slot (mapping -> -1); with
        `defer_mapping_resets`, host slots are kept for the next mapping access instead.

        Host slots are checked first (TypeError / ValueError naming the slot, mapping
        unchanged): a bad one kept for later would fail the next decode step instead."""
        if not isinstance(full_slots, torch.Tensor) or full_slots.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise TypeError(
                "full_slots must be an int32/int64 tensor, got"
                f" {getattr(full_slots, 'dtype', None)} {type(full_slots).__name__}"
            )
        if not full_slots.numel():
            return
        if full_slots.device.type == "cpu":
            n = self.full_to_swa_index_mapping.shape[0]
            bad = (full_slots < 0) | (full_slots >= n)
            if bool(bad.any()):
                slot = int(full_slots.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]])
                raise ValueError(f"full_slots: slot {slot} is outside the full pool [0, {n})")
        if self.defer_mapping_resets and full_slots.device.type == "cpu":
            self._pending_resets.append(full_slots.to(torch.int64).reshape(-1))
            return
        self._reset_now(full_slots)

    def _reset_now(self, full_slots: torch.Tensor) -> None:
        full = upload(full_slots, self.device, torch.int64)
        # index_fill_, not `[full] = -1`: the scalar would be a host copy, a sync
        self.full_to_swa_index_mapping.index_fill_(0, full, -1)

    def flush_mapping_resets(self) -> None:
        """Apply the deferred mapping resets now (an upload and an index_fill_)."""
        full = self.take_mapping_resets()
        if full is not None:
            self._reset_now(full)

    def take_mapping_resets(self) -> torch.Tensor | None:
        """The deferred resets (host int64 [n] full slots), handed to a caller that applies
        them before any other write to the mapping (the decode step's table kernel), or None.
        `requeue_mapping_resets` gives them back if it cannot."""
        if not self._pending_resets:
            return None
        pending, self._pending_resets = self._pending_resets, []
        return torch.cat(pending)

    def requeue_mapping_resets(self, full_slots: torch.Tensor) -> None:
        """Put resets taken by `take_mapping_resets` back, ahead of any deferred since."""
        self._pending_resets.insert(0, full_slots)

    # ------------------------------------------------------------------ writes
    def set_stream_overlap(self, enabled: bool) -> None:
        self.full_kv_pool.set_stream_overlap(enabled)
        self.swa_kv_pool.set_stream_overlap(enabled)

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
        """Store K [T, H, D] and V [T, H, Dv] of T tokens given by their *full* slots `loc`
        (int [T], < 0 = skip); window layers write the tokens' window slots (-1: skipped)."""
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        pool, idx, swa = self._layer(layer_id)
        if swa and isinstance(loc, torch.Tensor):
            loc = self.translate_loc_from_full_to_swa(loc)
        pool.set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale, idx)

    # ------------------------------------------------------------------ hygiene
    def zero_slots(self, indices: torch.Tensor) -> None:
        """Zero the full layers' K/V at full slots `indices` (the full allocator's scrub; the
        window allocator scrubs `swa_kv_pool` itself)."""
        self.full_kv_pool.zero_slots(indices)

    def scrub_table(self) -> SlotTable | None:
        """zero_slots' one-launch table (the full layers'), or None."""
        return self.full_kv_pool.scrub_table()

    def clear(self) -> None:
        """Zero every K/V byte of both pools and forget every window slot."""
        self.full_kv_pool.clear()
        self.swa_kv_pool.clear()
        self._pending_resets.clear()
        self.full_to_swa_index_mapping.fill_(-1)
        self._reset_padding()

    def get_kv_size_bytes(self) -> tuple[int, int]:
        """(K bytes, V bytes) of both pools together."""
        fk, fv = self.full_kv_pool.get_kv_size_bytes()
        sk, sv = self.swa_kv_pool.get_kv_size_bytes()
        return fk + sk, fv + sv

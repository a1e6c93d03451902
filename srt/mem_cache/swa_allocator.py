"""SWATokenToKVPoolAllocator: slots of the full pool and of the sliding-window pool together.

Named after SGLang's allocator of the same name. Two `PagedTokenToKVPoolAllocator`s (host
bookkeeping, page 0 never handed out, exact checks) hand out the full slots and the window slots
of the same tokens. Window pages are aligned with token positions exactly like full pages (token
i sits at offset i % page_size of its page in both pools), so a request's window pages cover a
contiguous run of its token pages and can be freed page by page as tokens leave the window.

Every allocation takes both kinds of slots or none: if the window pool is full, the full pages
just taken are given back. Each allocation records the full -> window mapping of the new tokens
in the pool (`SWAKVPool.set_swa_mapping`); freeing window slots resets it to -1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, ScrubList
from srt.mem_cache.swa_memory_pool import SWAKVPool


@dataclass(frozen=True)
class SWASlots:
    """The slots of one allocation: token t got full slot full[t] and window slot swa[t]."""

    full: torch.Tensor  # host int64 [n]
    swa: torch.Tensor  # host int64 [n]


class SWATokenToKVPoolAllocator:
    """Allocates full and window slots together (see the module docstring).

    Parameters
    ----------
    size, size_swa : int
        Usable full / window slots (multiples of page_size).
    page_size : int
    device : str or torch.device
        The KV cache's device; slots are returned on the host.
    kvcache : SWAKVPool
        Receives the full -> window mapping; scrubbed on allocation with `scrub_on_alloc`.
    scrub_on_alloc : bool
        Zero every newly handed-out page (full and window) before it is used.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        page_size: int,
        device: str | torch.device,
        kvcache: SWAKVPool,
        *,
        scrub_on_alloc: bool = False,
    ) -> None:
        self.full_attn_allocator = PagedTokenToKVPoolAllocator(
            size, page_size, device, kvcache=kvcache, scrub_on_alloc=scrub_on_alloc
        )
        self.swa_attn_allocator = PagedTokenToKVPoolAllocator(
            size_swa,
            page_size,
            device,
            kvcache=kvcache.swa_kv_pool,
            scrub_on_alloc=scrub_on_alloc,
        )
        self.size, self.size_swa, self.page_size = size, size_swa, page_size
        self.device = torch.device(device)
        self._kvcache = kvcache

    def get_kvcache(self) -> SWAKVPool:
        return self._kvcache

    def available_size(self) -> int:
        """Free full slots (whole free pages times page_size)."""
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        """Free window slots (whole free pages times page_size)."""
        return self.swa_attn_allocator.available_size()

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()

    @contextmanager
    def deferred_scrub(self) -> Iterator[ScrubList]:
        """Both pools' scrubs listed for the caller (see the full allocator's)."""
        with self.full_attn_allocator.deferred_scrub() as sink:
            with self.swa_attn_allocator.deferred_scrub(sink):
                yield sink

    # ------------------------------------------------------------------ allocation
    def _both(self, take_full, take_swa, set_mapping: bool = True) -> SWASlots | None:
        """Run the full allocation, then the window one; undo the first if the second fails."""
        full_alloc = self.full_attn_allocator
        free_before = full_alloc._num_free
        sink = full_alloc._scrub_sink
        listed = 0 if sink is None else len(sink)
        full = take_full()
        if full is None:
            return None
        try:
            swa = take_swa()
        except BaseException:
            self._undo_full(free_before, listed)
            raise
        if swa is None:
            self._undo_full(free_before, listed)
            return None
        if set_mapping:
            self._kvcache.set_swa_mapping(full, swa)
        return SWASlots(full, swa)

    def _undo_full(self, free_before: int, listed: int) -> None:
        """Give back the pages the last full allocation popped off the free stack (and drop
        their deferred scrub, past the first `listed` entries)."""
        a = self.full_attn_allocator
        a._live[a._stack[a._num_free : free_before]] = False
        a._num_free = free_before
        if a._scrub_sink is not None:
            del a._scrub_sink[listed:]

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        *,
        swa_last_loc: torch.Tensor,
    ) -> SWASlots | None:
        """Full and window slots for tokens prefix_lens[i] .. seq_lens[i] - 1 of request i.

        Parameters
        ----------
        prefix_lens, seq_lens, last_loc, extend_num_tokens : as
            `PagedTokenToKVPoolAllocator.alloc_extend` (last_loc: the full slot of token
            prefix_lens[i] - 1).
        swa_last_loc : int32/int64 [B]
            The window slot of token prefix_lens[i] - 1 (any value when prefix_lens[i] == 0).

        Returns
        -------
        SWASlots (host int64 [extend_num_tokens] each, request order), or None if either pool
        lacks the pages (nothing changes then).
        """
        return self._both(
            lambda: self.full_attn_allocator.alloc_extend(
                prefix_lens, seq_lens, last_loc, extend_num_tokens
            ),
            lambda: self.swa_attn_allocator.alloc_extend(
                prefix_lens, seq_lens, swa_last_loc, extend_num_tokens
            ),
        )

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        *,
        swa_last_loc: torch.Tensor,
        set_mapping: bool = True,
    ) -> SWASlots | None:
        """One full and one window slot per request (seq_lens include the new token; last_loc /
        swa_last_loc: the full / window slot of token seq_lens[i] - 2). None if either pool is
        full (nothing changes then). set_mapping=False leaves the full -> window mapping of the
        new slots to the caller (the decode step writes it with the request tables)."""
        return self._both(
            lambda: self.full_attn_allocator.alloc_decode(seq_lens, last_loc),
            lambda: self.swa_attn_allocator.alloc_decode(seq_lens, swa_last_loc),
            set_mapping,
        )

    # ------------------------------------------------------------------ freeing
    def free(self, free_index: torch.Tensor) -> None:
        """Free the full pages holding the given full slots (window slots: `free_swa`)."""
        self.full_attn_allocator.free(free_index)

    def free_swa(self, swa_index: torch.Tensor, full_index: torch.Tensor) -> None:
        """Free the window pages holding `swa_index` [n] (any slot of a page frees it) and mark
        the tokens in full slots `full_index` [m] as having no window slot.

        Raises TypeError for anything but int32/int64 tensors, and ValueError on a double free,
        a window slot that was never handed out, or a full slot that is not allocated; nothing
        is freed and the mapping is unchanged then (the full slots are checked first: the
        window free checks its own slots before it frees any)."""
        for name, t in (("swa_index", swa_index), ("full_index", full_index)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(
                    f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', None)}"
                    f" {type(t).__name__}"
                )
        full = full_index.to("cpu", torch.int64).reshape(-1)  # [m]
        if full.numel():
            self.full_attn_allocator._check_owned("full_index", full)
        self.swa_attn_allocator._free("swa_index", swa_index)
        self._kvcache.reset_swa_mapping(full)

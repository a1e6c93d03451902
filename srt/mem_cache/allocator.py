"""KV-slot allocators: which cache slots (pages) each request's tokens use.

Names follow SGLang's `srt/mem_cache/allocator.py`. The allocators only hand out indices; they
never touch K/V memory unless given a pool and `scrub_on_alloc=True`, in which case every newly
handed-out page is zeroed first (so no request can ever see what a previous one left behind).

Slot s lives in page s // page_size. Page 0 (slots 0 .. page_size - 1) is the padding page of
`MHATokenToKVPool`: it is never handed out and freeing it is a no-op.

The free list is a 1-D int64 tensor of page ids on `device`; allocation takes its head, freeing
appends. All bookkeeping is vectorised torch, so it runs (and is tested) on CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch


class _Scrubbable(Protocol):
    def zero_slots(self, indices: torch.Tensor) -> None: ...


def _index_tensor(name: str, t: object, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D [batch], got shape {tuple(t.shape)}")
    return t.to(device=device, dtype=torch.int64)


class PagedTokenToKVPoolAllocator:
    """Allocates whole pages of `page_size` slots; a request's last page may be partly filled.

    Parameters
    ----------
    size : int
        Usable slots (a multiple of page_size); pages 1 .. size // page_size are handed out.
    page_size : int
    device : str or torch.device
    kvcache : pool with `zero_slots(indices)`, optional
        Needed only for `scrub_on_alloc`.
    scrub_on_alloc : bool
        Zero every newly allocated page in `kvcache` before handing it out.
    debug_mode : bool
        Check frees for out-of-range pages and double frees (reads the indices: syncs the device).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device: str | torch.device,
        *,
        kvcache: _Scrubbable | None = None,
        scrub_on_alloc: bool = False,
        debug_mode: bool = False,
    ) -> None:
        for name, x in (("size", size), ("page_size", page_size)):
            if not isinstance(x, int) or isinstance(x, bool) or x <= 0:
                raise ValueError(f"{name} must be a positive int, got {x!r}")
        if size % page_size:
            raise ValueError(f"size {size} must be a multiple of page_size {page_size}")
        if scrub_on_alloc and kvcache is None:
            raise ValueError("scrub_on_alloc needs kvcache (the pool whose slots are zeroed)")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._kvcache = kvcache
        self.scrub_on_alloc = scrub_on_alloc
        self.debug_mode = debug_mode
        self.clear()

    # ------------------------------------------------------------------ basics
    def clear(self) -> None:
        """Every page 1 .. num_pages free again (page 0 is padding)."""
        self.free_pages = torch.arange(
            1, self.num_pages + 1, dtype=torch.int64, device=self.device
        )  # [num_pages]

    def available_size(self) -> int:
        """Free slots (whole free pages times page_size)."""
        return len(self.free_pages) * self.page_size

    def get_kvcache(self) -> _Scrubbable | None:
        return self._kvcache

    def backup_state(self) -> torch.Tensor:
        return self.free_pages.clone()

    def restore_state(self, state: torch.Tensor) -> None:
        self.free_pages = state.clone()

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]  # [n], [rest]
        if self.scrub_on_alloc and n:
            assert self._kvcache is not None
            self._kvcache.zero_slots(self._page_slots(pages))
        return pages

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offs = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages[:, None] * self.page_size + offs).reshape(-1)  # [n * page_size]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (a multiple of page_size) in whole pages, int64; None if full."""
        if not isinstance(need_size, int) or need_size < 0 or need_size % self.page_size:
            raise ValueError(
                f"need_size must be a non-negative multiple of page_size {self.page_size},"
                f" got {need_size!r}"
            )
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._page_slots(pages)

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages holding the given slots (call with all of a request's slots at its end).

        Slots of page 0 (padding) are ignored.
        """
        if not isinstance(free_index, torch.Tensor) or free_index.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise TypeError("free_index must be an int32/int64 tensor")
        if free_index.numel() == 0:
            return
        pages = torch.unique(free_index.to(self.device, torch.int64).reshape(-1) // self.page_size)
        pages = pages[pages != 0]
        if self.debug_mode:
            self._check_free(pages)
        self.free_pages = torch.cat((self.free_pages, pages))

    def _check_free(self, pages: torch.Tensor) -> None:
        if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) > self.num_pages):
            raise ValueError(f"freeing pages outside [1, {self.num_pages}]: {pages.tolist()}")
        if torch.isin(pages, self.free_pages).any():
            raise ValueError("double free: some of these pages are already free")

    # ------------------------------------------------------------------ paged allocation
    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for tokens prefix_lens[i] .. seq_lens[i] - 1 of every request i.

        Parameters
        ----------
        prefix_lens, seq_lens : int [B]
            Tokens already cached, and the length after this extend (seq >= prefix >= 0).
        last_loc : int [B]
            Slot of token prefix_lens[i] - 1 (any value, e.g. -1, when prefix_lens[i] == 0). The
            free rest of its page is filled first.
        extend_num_tokens : int
            sum(seq_lens - prefix_lens), known on the host.

        Returns
        -------
        int64 [extend_num_tokens] slots in request order, or None if not enough pages are free.
        """
        prefix = _index_tensor("prefix_lens", prefix_lens, self.device)
        seq = _index_tensor("seq_lens", seq_lens, self.device)
        last = _index_tensor("last_loc", last_loc, self.device)
        if not prefix.shape == seq.shape == last.shape:
            raise ValueError(
                f"prefix_lens {tuple(prefix.shape)}, seq_lens {tuple(seq.shape)} and last_loc"
                f" {tuple(last.shape)} must have the same shape"
            )
        ext = seq - prefix  # [B]
        if bool((prefix < 0).any()) or bool((ext < 0).any()):
            raise ValueError("need seq_lens >= prefix_lens >= 0")
        if int(ext.sum()) != extend_num_tokens:
            raise ValueError(
                f"extend_num_tokens {extend_num_tokens} != sum(seq_lens - prefix_lens)"
                f" = {int(ext.sum())}"
            )
        ps = self.page_size
        prefix_pages_end = (prefix + ps - 1) // ps * ps  # [B] first slot offset past prefix pages
        new_pages = (seq + ps - 1) // ps - prefix_pages_end // ps  # [B]
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        if extend_num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        # token t belongs to request req[t] and sits at position pos[t] of it
        req = torch.repeat_interleave(
            torch.arange(len(ext), device=self.device), ext, output_size=extend_num_tokens
        )  # [T]
        tok_start = torch.cumsum(ext, 0) - ext  # [B] exclusive cumsum
        pos = prefix[req] + torch.arange(extend_num_tokens, device=self.device) - tok_start[req]
        page_start = torch.cumsum(new_pages, 0) - new_pages  # [B] first new page of each request
        in_old_page = pos < prefix_pages_end[req]  # [T] fills the partly filled last page
        k = ((pos - prefix_pages_end[req]) // ps).clamp(min=0)  # [T] new-page ordinal
        padded = torch.cat((pages, pages.new_zeros(1)))  # [n + 1]: safe to index when n == 0
        new_slot = padded[(page_start[req] + k).clamp(max=len(pages))] * ps + pos % ps
        old_slot = last[req] + (pos - prefix[req]) + 1
        return torch.where(in_old_page, old_slot, new_slot)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its new token.

        Parameters
        ----------
        seq_lens : int [B]
            Lengths including the new token (>= 1).
        last_loc : int [B]
            Slot of token seq_lens[i] - 2 (ignored when the new token starts a page).

        Returns
        -------
        int64 [B] slots, or None if not enough pages are free.
        """
        seq = _index_tensor("seq_lens", seq_lens, self.device)
        last = _index_tensor("last_loc", last_loc, self.device)
        if seq.shape != last.shape:
            raise ValueError(
                f"seq_lens {tuple(seq.shape)} and last_loc {tuple(last.shape)} must match"
            )
        if bool((seq < 1).any()):
            raise ValueError("alloc_decode needs seq_lens >= 1 (they include the new token)")
        starts_page = (seq - 1) % self.page_size == 0  # [B]
        n = int(starts_page.sum())
        pages = self._take_pages(n)
        if pages is None:
            return None
        page_of = torch.cumsum(starts_page.to(torch.int64), 0) - 1  # [B] index into pages
        padded = torch.cat((pages, pages.new_zeros(1)))  # [n + 1]: safe to index when n == 0
        new_slot = padded[page_of.clamp(min=0)] * self.page_size
        return torch.where(starts_page, new_slot, last + 1)


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Slot-granular allocator (page_size 1): `alloc(n)` returns any n free slots, never slot 0."""

    def __init__(
        self,
        size: int,
        device: str | torch.device,
        *,
        kvcache: _Scrubbable | None = None,
        scrub_on_alloc: bool = False,
        debug_mode: bool = False,
    ) -> None:
        super().__init__(
            size, 1, device, kvcache=kvcache, scrub_on_alloc=scrub_on_alloc, debug_mode=debug_mode
        )

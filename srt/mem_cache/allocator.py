"""KV-slot allocators: which cache slots (pages) each request's tokens use.

Names follow SGLang's `srt/mem_cache/allocator.py`. The allocators only hand out indices; they
never touch K/V memory unless given a pool and `scrub_on_alloc=True`, in which case every newly
handed-out page is zeroed first (so no request can ever see what a previous one left behind).

Slot s lives in page s // page_size. Page 0 (slots 0 .. page_size - 1) is the padding page of
`MHATokenToKVPool`: it is never handed out, and freeing it is an error like freeing any other
slot that is not allocated.

All bookkeeping lives on the host: a stack of free page ids and a bitmap of live pages (CPU
tensors), so every check is exact and costs O(indices passed) with no device synchronisation.
Slots are returned as host (CPU) int64 tensors; the scheduler keeps them there and copies each
batch's slots to the device once. Index arguments given on a device are copied to the host
(a synchronisation: pass host tensors on the hot path).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

_HOST = torch.device("cpu")


class _Scrubbable(Protocol):
    def zero_slots(self, indices: torch.Tensor) -> None: ...


# A scrub left to the caller (`deferred_scrub`): the pool and the host int64 slots to zero.
ScrubList = list[tuple[_Scrubbable, torch.Tensor]]


def _host_index(name: str, t: object) -> torch.Tensor:
    """int64 [batch] host copy of a 1-D int32/int64 tensor (TypeError/ValueError otherwise)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {getattr(t, 'dtype', type(t))}")
    if t.ndim != 1:
        raise ValueError(f"{name} must be 1-D [batch], got shape {tuple(t.shape)}")
    return t.to(device=_HOST, dtype=torch.int64)


class PagedTokenToKVPoolAllocator:
    """Allocates whole pages of `page_size` slots; a request's last page may be partly filled.

    Every call checks its arguments before it changes anything: a double free, a free of a
    slot never handed out (page 0 included) or out of range, a `last_loc` that is not an
    allocated slot at the right offset, or two requests' `last_loc` in one page that is not
    full (both would fill its rest) raise ValueError naming the slot; arguments of the wrong
    type raise TypeError. The allocator is unchanged then.

    Parameters
    ----------
    size : int
        Usable slots (a multiple of page_size); pages 1 .. size // page_size are handed out.
    page_size : int
    device : str or torch.device
        Device of the KV cache (SGLang's signature); slots themselves are returned on the host.
    kvcache : pool with `zero_slots(indices)`, optional
        Needed only for `scrub_on_alloc`.
    scrub_on_alloc : bool
        Zero every newly allocated page in `kvcache` before handing it out.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device: str | torch.device,
        *,
        kvcache: _Scrubbable | None = None,
        scrub_on_alloc: bool = False,
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
        self._scrub_sink: ScrubList | None = None  # set inside deferred_scrub
        self.clear()

    # ------------------------------------------------------------------ basics
    def clear(self) -> None:
        """Every page 1 .. num_pages free again (page 0 is padding)."""
        # Free pages are _stack[:_num_free]; allocation pops from the top, so the lowest ids
        # come first on a fresh allocator.
        self._stack = torch.arange(self.num_pages, 0, -1, dtype=torch.int64)  # [num_pages]
        self._num_free = self.num_pages
        # Live pages; entry num_pages + 1 stays False, so clamped out-of-range pages read False.
        self._live = torch.zeros(self.num_pages + 2, dtype=torch.bool)  # [num_pages + 2]
        # Scratch for finding repeated indices in O(n) (no sort): see _first_occurrence.
        self._slot_mark = torch.zeros((self.num_pages + 1) * self.page_size, dtype=torch.int64)
        self._page_mark = (
            self._slot_mark
            if self.page_size == 1
            else torch.zeros(self.num_pages + 1, dtype=torch.int64)
        )

    @property
    def free_pages(self) -> torch.Tensor:
        """int64 [free pages] host copy of the free page ids, in the order they are handed out."""
        return self._stack[: self._num_free].flip(0)

    def available_size(self) -> int:
        """Free slots (whole free pages times page_size)."""
        return self._num_free * self.page_size

    def get_kvcache(self) -> _Scrubbable | None:
        return self._kvcache

    def _peek_pages(self, n: int) -> torch.Tensor | None:
        """int64 [n] the next n free pages (not yet taken), or None if fewer are free."""
        if n > self._num_free:
            return None
        return self._stack[self._num_free - n : self._num_free].flip(0)

    @contextmanager
    def deferred_scrub(self, sink: ScrubList | None = None) -> Iterator[ScrubList]:
        """Within the block, pages handed out are listed as (pool, host slots) instead of being
        scrubbed; the caller zeroes them (`pool.zero_slots`) before the step that uses them.
        The decode step does, from its one upload (ScheduleBatch.prepare_for_decode)."""
        sink = [] if sink is None else sink
        self._scrub_sink = sink
        try:
            yield sink
        finally:
            self._scrub_sink = None

    def _take(self, pages: torch.Tensor) -> None:
        """Hand out the pages `_peek_pages` returned (scrubbed first if asked)."""
        n = len(pages)
        if self.scrub_on_alloc and n:
            assert self._kvcache is not None
            if self._scrub_sink is not None:
                self._scrub_sink.append((self._kvcache, self._page_slots(pages)))
            else:
                self._kvcache.zero_slots(self._page_slots(pages))
        self._live[pages] = True
        self._num_free -= n

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offs = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offs).reshape(-1)  # [n * page_size]

    @staticmethod
    def _first_occurrence(mark: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """bool [n]: True at one occurrence of each distinct value of idx (values index mark)."""
        order = torch.arange(len(idx), dtype=torch.int64)  # [n]
        mark[idx] = order  # of repeated values, one write wins ...
        return mark[idx] == order  # ... and only that occurrence reads its own position back

    def _check_owned(self, name: str, slots: torch.Tensor, first_entry: int = 0) -> None:
        """ValueError naming the first slot that is out of range or not in a live page."""
        ps = self.page_size
        pages = slots // ps
        in_range = (pages >= 1) & (pages <= self.num_pages)
        bad = ~in_range
        if not bool(bad.any()):
            bad = ~self._live[pages]
            what = "is not allocated (double free, or never handed out)"
        else:
            what = f"is outside the allocatable slots [{ps}, {(self.num_pages + 1) * ps})"
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"{name}: slot {int(slots[i])} (entry {first_entry + i}) {what}")

    # ------------------------------------------------------------------ token allocation
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots (a multiple of page_size) in whole pages, host int64; None if full."""
        if (
            not isinstance(need_size, int)
            or isinstance(need_size, bool)
            or need_size < 0
            or need_size % self.page_size
        ):
            raise ValueError(
                f"need_size must be a non-negative multiple of page_size {self.page_size},"
                f" got {need_size!r}"
            )
        pages = self._peek_pages(need_size // self.page_size)
        if pages is None:
            return None
        self._take(pages)
        return self._page_slots(pages)

    def free(self, free_index: torch.Tensor) -> None:
        """Free the pages holding the given slots (call with all of a request's slots at its end).

        Parameters
        ----------
        free_index : int32/int64 [n]
            Slots; any slot of a page frees the whole page. Host tensors cost no synchronisation.

        Raises
        ------
        ValueError
            A slot listed twice, out of range, in page 0, or in a page that is not allocated;
            nothing is freed then.
        """
        self._free("free_index", free_index)

    def _free(self, name: str, free_index: torch.Tensor) -> None:
        """`free`, naming the argument `name` in its errors."""
        if not isinstance(free_index, torch.Tensor) or free_index.dtype not in (
            torch.int32,
            torch.int64,
        ):
            raise TypeError(
                f"{name} must be an int32/int64 tensor, got"
                f" {getattr(free_index, 'dtype', None)} {type(free_index).__name__}"
            )
        slots = free_index.to(_HOST, torch.int64).reshape(-1)  # [n]
        if slots.numel() == 0:
            return
        self._check_owned(name, slots)
        first = self._first_occurrence(self._slot_mark, slots)  # [n]
        if not bool(first.all()):
            dup = int(slots[~first][0])
            raise ValueError(f"{name}: slot {dup} listed twice (double free)")
        pages = slots // self.page_size  # [n]
        if self.page_size > 1:
            pages = pages[self._first_occurrence(self._page_mark, pages)]  # [p] distinct
        self._live[pages] = False
        self._stack[self._num_free : self._num_free + len(pages)] = pages
        self._num_free += len(pages)

    # ------------------------------------------------------------------ paged allocation
    def _check_last_loc(self, name: str, last: torch.Tensor, prev_pos: torch.Tensor) -> None:
        """Requests with a previous token (prev_pos >= 0) must name an allocated slot of it;
        where that page has a free rest (prev_pos + 1 not a page boundary), in a page no other
        request names: two requests naming one such page would fill its rest with each other's
        tokens. A full page may be named by many (a prefix shared through the radix cache:
        every request's next token starts a fresh page)."""
        ps, n = self.page_size, self.num_pages
        pages = last // ps  # [B]
        ok = self._live[pages.clamp(0, n + 1)]  # [B] in range and live (page 0 is not)
        if ps > 1:
            ok &= (last - prev_pos) % ps == 0  # at the previous token's offset within its page
        ok |= prev_pos < 0  # no previous token: last_loc is ignored
        if bool(ok.all()):  # the hot path: a handful of vectorised host ops
            if len(last) > 1 and ps > 1:  # (page_size 1: every page is full)
                self._check_last_pages_distinct(name, last, pages, prev_pos)
            return
        bad = ~ok
        i = int(bad.nonzero()[0, 0])
        self._check_owned(name, last[i : i + 1], first_entry=i)
        raise ValueError(
            f"{name}[{i}] = {int(last[i])} is at page offset {int(last[i]) % ps},"
            f" but token {int(prev_pos[i])} of the request sits at offset"
            f" {int(prev_pos[i]) % ps} (page_size {ps})"
        )

    def _check_last_pages_distinct(
        self, name: str, last: torch.Tensor, pages: torch.Tensor, prev_pos: torch.Tensor
    ) -> None:
        """ValueError naming two requests whose last_loc lie in one page (`pages`: last //
        page_size; entries with prev_pos < 0 have no last_loc). On Python lists: for a batch's
        few hundred entries one host copy and a set beat a chain of small torch ops. Requests
        whose last page is full are left out: nothing is written into it."""
        ps = self.page_size
        pv = zip(pages.tolist(), prev_pos.tolist(), strict=True)
        # (page, request) of the requests whose next token goes into the same page
        held = [(p, i) for i, (p, v) in enumerate(pv) if v >= 0 and (v + 1) % ps]
        if len({p for p, _ in held}) == len(held):
            return
        first: dict[int, int] = {}
        for p, k in held:  # the error path: the first repeated page, in request order
            if p in first:
                i = first[p]
                raise ValueError(
                    f"{name}[{i}] = {int(last[i])} and {name}[{k}] = {int(last[k])} are in the"
                    f" same page {p}: each request's last slot must be its own"
                    " (a repeated or another request's last_loc)"
                )
            first[p] = k

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
        prefix_lens, seq_lens : int32/int64 [B] (host, or copied there)
            Tokens already cached, and the length after this extend (seq >= prefix >= 0).
        last_loc : int32/int64 [B]
            Slot of token prefix_lens[i] - 1, which must be allocated (any value, e.g. -1,
            when prefix_lens[i] == 0); if its page is not full, the free rest of the page is
            filled first, and no other request's last_loc may name that page.
        extend_num_tokens : int
            sum(seq_lens - prefix_lens), known on the host.

        Returns
        -------
        host int64 [extend_num_tokens] slots in request order, or None if not enough pages are
        free (nothing changes then).
        """
        if not isinstance(extend_num_tokens, int) or isinstance(extend_num_tokens, bool):
            raise TypeError(
                f"extend_num_tokens must be an int, got {type(extend_num_tokens).__name__}"
                f" {extend_num_tokens!r}"
            )
        prefix = _host_index("prefix_lens", prefix_lens)
        seq = _host_index("seq_lens", seq_lens)
        last = _host_index("last_loc", last_loc)
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
        self._check_last_loc("last_loc", last, prefix - 1)
        ps = self.page_size
        prefix_pages_end = (prefix + ps - 1) // ps * ps  # [B] first slot offset past prefix pages
        new_pages = (seq + ps - 1) // ps - prefix_pages_end // ps  # [B]
        pages = self._peek_pages(int(new_pages.sum()))
        if pages is None:
            return None
        self._take(pages)
        if extend_num_tokens == 0:
            return torch.empty(0, dtype=torch.int64)
        # token t belongs to request req[t] and sits at position pos[t] of it
        req = torch.repeat_interleave(
            torch.arange(len(ext)), ext, output_size=extend_num_tokens
        )  # [T]
        tok_start = torch.cumsum(ext, 0) - ext  # [B] exclusive cumsum
        pos = prefix[req] + torch.arange(extend_num_tokens) - tok_start[req]  # [T]
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
        seq_lens : int32/int64 [B] (host, or copied there)
            Lengths including the new token (>= 1).
        last_loc : int32/int64 [B]
            Slot of token seq_lens[i] - 2, which must be allocated (any value when
            seq_lens[i] == 1); no other request's last_loc may name its page unless it is full.

        Returns
        -------
        host int64 [B] slots, or None if not enough pages are free (nothing changes then).
        """
        seq = _host_index("seq_lens", seq_lens)
        last = _host_index("last_loc", last_loc)
        if seq.shape != last.shape:
            raise ValueError(
                f"seq_lens {tuple(seq.shape)} and last_loc {tuple(last.shape)} must match"
            )
        if bool((seq < 1).any()):
            raise ValueError("alloc_decode needs seq_lens >= 1 (they include the new token)")
        self._check_last_loc("last_loc", last, seq - 2)
        if self.page_size == 1:  # every token starts a page
            pages = self._peek_pages(len(seq))
            if pages is not None:
                self._take(pages)
            return pages
        starts_page = (seq - 1) % self.page_size == 0  # [B]
        pages = self._peek_pages(int(starts_page.sum()))
        if pages is None:
            return None
        self._take(pages)
        out = last + 1  # [B] the next slot of the same page ...
        out[starts_page] = pages * self.page_size  # ... or the first slot of a new one, in order
        return out


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Slot-granular allocator (page_size 1): `alloc(n)` returns any n free slots, never slot 0."""

    def __init__(
        self,
        size: int,
        device: str | torch.device,
        *,
        kvcache: _Scrubbable | None = None,
        scrub_on_alloc: bool = False,
    ) -> None:
        super().__init__(size, 1, device, kvcache=kvcache, scrub_on_alloc=scrub_on_alloc)

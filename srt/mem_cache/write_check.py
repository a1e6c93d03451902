"""The KV write contract's debug check: a forward pass writes K/V only into its own slots.

With a prefix cache, pages are shared: the tree holds the pages of cached prefixes, which many
running requests read, and every other page is held by one request or is free. A forward pass
may write a token's K/V only into a slot of a page its own request holds privately (past the
request's `cache_protected_len`), at the slot the request's page list names for that token;
never into a page the tree holds, another request's page, a free page or the padding page.
That holds for every writer alike (the fused RoPE + KV kernel, the unfused `set_kv_buffer`,
CUDA-graph padding rows), because all of them write exactly the batch's `out_cache_loc`
(padding rows the padding slot 0, or nothing for slot < 0).

On the hybrid sliding-window pool the same holds for the window pool: each new token's window
slot (the full -> window mapping of its full slot, `out_cache_loc_swa`) must be the one its own
window page list names (`Req.swa_pages` past its cached prefix), never a window page of the
tree, of another request or a free one (`check_swa_writes`).

`check_kv_writes` checks a batch's `out_cache_loc` against that before the forward runs; with
`SGL_EXT_DEBUG=1` the scheduler calls it for every step (it reads the slots back to the host:
a synchronisation, debug only). `check_padding_writes` is the CUDA-graph runner's check of its
padding rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch


class KVWriteViolation(RuntimeError):
    """A forward pass would write K/V into a slot its request does not own."""


def kv_write_checks_enabled() -> bool:
    """Whether the (synchronising) write checks run: SGL_EXT_DEBUG=1."""
    from sgl_ext import settings

    return settings.get().debug


def check_kv_writes(
    out_cache_loc: torch.Tensor,
    reqs: Sequence[Any],
    new_tokens: Sequence[int],
    page_size: int,
    tree_pages: Iterable[int] = (),
    others: Sequence[Any] = (),
) -> None:
    """Raise KVWriteViolation, naming the token, slot and holder, if a batch would write a slot
    its request does not own.

    Parameters
    ----------
    out_cache_loc : int [T], the batch's slots (any device; read on the host).
    reqs : the batch's requests (`Req`), prepared: the new tokens are the last `new_tokens[i]`
        of request i's `kv_len`, in its `kv_pages`.
    new_tokens : tokens each request writes (1 per request for a decode step).
    page_size : tokens per page.
    tree_pages : pages the prefix cache holds.
    others : running requests outside the batch (their pages are theirs).
    """
    ps = page_size
    locs = out_cache_loc.reshape(-1).tolist()
    if len(locs) != sum(new_tokens) or len(reqs) != len(new_tokens):
        raise KVWriteViolation(
            f"out_cache_loc has {len(locs)} slots for {sum(new_tokens)} new tokens of"
            f" {len(reqs)} requests"
        )
    tree = set(tree_pages)
    holder: dict[int, str] = {p: "the radix tree (a cached prefix)" for p in tree}
    own: dict[int, set[int]] = {}
    for r in [*others, *reqs]:
        mine = r.kv_pages[r.cache_protected_len // ps :]
        own[id(r)] = set(mine)
        for p in mine:
            if p in holder:
                raise KVWriteViolation(
                    f"page {p} is held by request {r.rid} and by {holder[p]}: pages are never"
                    " shared but through the tree"
                )
            holder[p] = f"request {r.rid}"
    i = 0
    for r, n in zip(reqs, new_tokens, strict=True):
        first = r.kv_len - n
        for pos in range(first, r.kv_len):
            slot, i = locs[i], i + 1
            if slot < 0:  # "do not write" (the op skips it)
                continue
            page = slot // ps
            want = r.kv_pages[pos // ps] * ps + pos % ps
            if page in own[id(r)] and page not in tree and slot == want:
                continue
            if page == 0:
                what = "the padding page"
            elif page in own[id(r)]:
                what = f"its own page, but token {pos}'s slot is {want}"
            elif page in holder:
                what = holder[page]
            else:
                what = "no request (a free page)"
            raise KVWriteViolation(
                f"KV write contract: token {pos} of request {r.rid} would write slot {slot}"
                f" (page {page}), held by {what}; nothing was written"
            )


def _own_swa(r: Any, ps: int) -> dict[int, int]:
    """Token page -> window page of the request's own window pages."""
    first = max(r.swa_page_start, r.cache_protected_len // ps)
    return {
        r.swa_page_start + k: p for k, p in enumerate(r.swa_pages) if r.swa_page_start + k >= first
    }


def check_swa_writes(
    swa_loc: torch.Tensor,
    reqs: Sequence[Any],
    new_tokens: Sequence[int],
    page_size: int,
    tree_swa_pages: Iterable[int] = (),
    others: Sequence[Any] = (),
) -> None:
    """`check_kv_writes` for the window pool: swa_loc (int [T], the window slot each new token
    writes, -1: none) against the requests' own window pages (`Req.swa_pages` past their
    cached prefix), the tree's window pages and the other running requests'."""
    ps = page_size
    locs = swa_loc.reshape(-1).tolist()
    holder: dict[int, str] = {
        p: "the radix tree (a cached prefix's window)" for p in tree_swa_pages
    }
    for r in others:
        for p in _own_swa(r, ps).values():
            holder[p] = f"request {r.rid}"
    i = 0
    for r, n in zip(reqs, new_tokens, strict=True):
        own = _own_swa(r, ps)
        for pos in range(r.kv_len - n, r.kv_len):
            slot, i = locs[i], i + 1
            if slot < 0:
                continue
            page = own.get(pos // ps)
            if page is not None and slot == page * ps + pos % ps and slot // ps not in holder:
                continue
            what = holder.get(slot // ps, "the padding page" if slot < ps else "no owner here")
            raise KVWriteViolation(
                f"KV write contract: token {pos} of request {r.rid} would write window slot"
                f" {slot} (page {slot // ps}), held by {what}; nothing was written"
            )


def check_batch_writes(
    fb: Any, reqs: Sequence[Any], running: Sequence[Any], tree_cache: Any, page_size: int
) -> None:
    """`check_kv_writes` for a prepared EXTEND or DECODE batch of `reqs`, beside the other
    `running` requests and the pages of `tree_cache` (a RadixCache or None); on a hybrid
    pool `check_swa_writes` too."""
    mine = {id(r) for r in reqs}
    others = [r for r in running if id(r) not in mine and r.req_pool_idx is not None]
    new = fb.extend_seq_lens_cpu if fb.forward_mode.is_extend() else [1] * len(reqs)
    tree = tree_cache.held_pages() if tree_cache is not None else ()
    check_kv_writes(fb.out_cache_loc, reqs, new, page_size, tree, others)
    translate = getattr(fb.token_to_kv_pool, "translate_loc_from_full_to_swa", None)
    if translate is not None:
        swa = fb.out_cache_loc_swa
        swa = translate(fb.out_cache_loc) if swa is None else swa
        held = getattr(tree_cache, "held_swa_pages", None)
        check_swa_writes(swa, reqs, new, page_size, held() if held else (), others)


def check_padding_writes(out_cache_loc: torch.Tensor, page_size: int) -> None:
    """Raise KVWriteViolation if a CUDA-graph padding row's slot is outside the padding page
    (slot < page_size, or < 0: not written)."""
    bad = out_cache_loc[out_cache_loc >= page_size]
    if bad.numel():
        raise KVWriteViolation(
            f"KV write contract: a CUDA-graph padding row would write slot {int(bad[0])},"
            " outside the padding page"
        )

"""A decode step's device writes in one launch.

Each decode step writes, for every request, its new token's KV slot into the request's row of
`req_to_token` (and, with a hybrid pool, the window slot into `req_to_swa_token` and into the
full -> window mapping), and, in the overlapped decode, copies the previous step's ids into
the step's input ids. As torch ops that is an index cast and an `index_put` per table, a
device copy, and the mapping's own uploads: ~10 launches of ~2.5 µs each between two decode
graphs. `write_decode_rows` reads everything from the step's decode block (one upload) in one
kernel; `write_decode_rows_native` is the same writes in torch (CPU, and the test oracle).

The same launch can also (each optional):
- store the block into the decode graph's static inputs (`dest`), so the replay copies nothing;
- store the previous step's ids into pinned host memory (`host_ids`): the host reads them
  there, with no device-to-host copy between the graphs;
- mark full slots as having no window slot in the mapping (`resets`, before the new entries);
- zero the new pages' slots in every layer's K and V (`scrubs`, the allocator's deferred scrub,
  for pools with a `scrub_table`).

The block is `ScheduleBatch.prepare_for_decode`'s int64 [5 or 6, B]: input ids, request rows,
sequence lengths, new slots, positions (and new window slots), each row contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher
from srt.mem_cache.scrub import SlotTable, row_block, zero_slot_row

_BLOCK = 128  # requests a program writes


@triton.jit
def _decode_rows_kernel(
    # the pointers first, then the integers (CachedLauncher's convention: direct launches)
    Block,  # int64 [R, B]: ids, rows, seq_lens, slots, positions (, window slots)
    Ids,  # int64 [B] ids to copy into block row 0 (HAS_IDS)
    ReqToToken,  # int32 [rows, ctx] (both tables of one shape)
    ReqToSwa,  # int32 [rows, ctx] (HAS_SWA)
    Mapping,  # int64 [full slots] full -> window slot (HAS_SWA)
    Dest,  # int64 [R, >= B] at dest_stride (HAS_DEST): receives the block
    Host,  # int64 [B] pinned host memory (HAS_HOST): receives Ids
    Resets,  # int64 [n_resets] full slots whose mapping entry becomes -1 (HAS_SWA)
    BasesA,  # scrub A (SCRUBS >= 1): SlotTable bases / row words, slots [n_a]
    WordsA,
    SlotsA,
    BasesB,  # scrub B (SCRUBS == 2)
    WordsB,
    SlotsB,
    B,
    r2t_stride,
    r2s_stride,
    n_rows,
    ctx,
    n_map,
    dest_stride,
    n_resets,
    row_programs,  # programs of the rows above; the scrubs' programs follow
    n_a,
    bufs_a,
    n_b,
    bufs_b,
    HAS_IDS: tl.constexpr,
    HAS_SWA: tl.constexpr,
    HAS_DEST: tl.constexpr,
    HAS_HOST: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCRUBS: tl.constexpr = 0,
    BLOCK_A: tl.constexpr = 1,
    BITS_A: tl.constexpr = 64,
    BLOCK_B: tl.constexpr = 1,
    BITS_B: tl.constexpr = 64,
):
    pid = tl.program_id(0)
    if pid < row_programs:
        i = pid * BLOCK + tl.arange(0, BLOCK)
        m = i < B
        row = tl.load(Block + B + i, mask=m, other=0)
        slot = tl.load(Block + 3 * B + i, mask=m, other=0)
        pos = tl.load(Block + 4 * B + i, mask=m, other=0)
        if HAS_IDS:
            ids = tl.load(Ids + i, mask=m, other=0)
            tl.store(Block + i, ids, mask=m)
            if HAS_HOST:
                tl.store(Host + i, ids, mask=m)
        if HAS_SWA:  # the host keeps a reset and a new entry of one slot out of one launch
            rm = i < n_resets  # (row_programs cover max(B, n_resets))
            gone = tl.load(Resets + i, mask=rm, other=-1)
            none = tl.full([BLOCK], -1, tl.int64)
            tl.store(Mapping + gone, none, mask=rm & (gone >= 0) & (gone < n_map))
        # the caller's invariant keeps every entry inside the tables; these bounds only make
        # sure a broken one cannot write outside them
        cell = m & (row >= 0) & (row < n_rows) & (pos >= 0) & (pos < ctx)
        tl.store(ReqToToken + row * r2t_stride + pos, slot.to(tl.int32), mask=cell)
        if HAS_SWA:
            swa = tl.load(Block + 5 * B + i, mask=m, other=0)
            tl.store(ReqToSwa + row * r2s_stride + pos, swa.to(tl.int32), mask=cell)
            tl.store(Mapping + slot, swa, mask=m & (slot >= 0) & (slot < n_map))
        if HAS_DEST:  # the block's rows into the graph's static inputs (ids written above)
            for r in tl.static_range(ROWS):
                v = tl.load(Block + r * B + i, mask=m, other=0)
                if r == 0 and HAS_IDS:
                    v = ids
                tl.store(Dest + r * dest_stride + i, v, mask=m)
    elif SCRUBS >= 1:  # program (slot, buffer) of scrub A, then of scrub B
        q = pid - row_programs
        if q < n_a * bufs_a:
            zero_slot_row(BasesA, WordsA, SlotsA, q // bufs_a, q % bufs_a, BLOCK_A, BITS_A)
        elif SCRUBS == 2:
            q -= n_a * bufs_a
            zero_slot_row(BasesB, WordsB, SlotsB, q // bufs_b, q % bufs_b, BLOCK_B, BITS_B)


@dataclass(frozen=True)
class StepExtras:
    """The optional parts of `write_decode_rows` (see its docstring): dest, host_ids, resets,
    scrubs."""

    dest: torch.Tensor | None = None
    host_ids: torch.Tensor | None = None
    resets: torch.Tensor | None = None
    scrubs: Sequence[tuple[Any, torch.Tensor]] = ()


_NONE = StepExtras()


def _check(
    block: torch.Tensor,
    req_to_token: torch.Tensor,
    req_to_swa_token: torch.Tensor | None,
    mapping: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    extras: StepExtras,
) -> None:
    rows = 5 if req_to_swa_token is None else 6
    if block.dim() != 2 or block.shape[0] != rows or block.dtype != torch.int64:
        raise ValueError(f"block must be int64 [{rows}, B], got {block.dtype} {tuple(block.shape)}")
    if not block.is_contiguous():
        raise ValueError("block must be contiguous")
    if (req_to_swa_token is None) != (mapping is None):
        raise ValueError("req_to_swa_token and mapping go together (hybrid pool)")
    for name, t in (("req_to_token", req_to_token), ("req_to_swa_token", req_to_swa_token)):
        if t is not None and (t.dim() != 2 or t.dtype != torch.int32 or t.stride(1) != 1):
            raise ValueError(f"{name} must be int32 [rows, ctx] with unit column stride")
    if req_to_swa_token is not None and req_to_swa_token.shape != req_to_token.shape:
        raise ValueError("req_to_swa_token must have req_to_token's shape")
    if mapping is not None and (mapping.dim() != 1 or mapping.dtype != torch.int64):
        raise ValueError("mapping must be int64 [full slots]")
    b = block.shape[1]
    if input_ids is not None and (input_ids.shape != (b,) or input_ids.dtype != torch.int64):
        raise ValueError(
            f"input_ids must be int64 [{b}], got {input_ids.dtype} {tuple(input_ids.shape)}"
        )
    dest, host, resets = extras.dest, extras.host_ids, extras.resets
    if dest is not None and (
        dest.dim() != 2
        or dest.shape != block.shape
        or dest.dtype != torch.int64
        or dest.stride(1) != 1
    ):
        raise ValueError(f"dest must be int64 {tuple(block.shape)} with contiguous rows")
    if host is not None:
        if input_ids is None:
            raise ValueError("host_ids needs input_ids (it receives them)")
        if host.shape != (b,) or host.dtype != torch.int64 or host.device.type != "cpu":
            raise ValueError(f"host_ids must be int64 [{b}] in host memory")
        if block.device.type == "cuda" and not host.is_pinned():
            raise ValueError("host_ids must be pinned (the kernel stores into it)")
    if resets is not None:
        if mapping is None:
            raise ValueError("resets need the mapping (hybrid pool)")
        if resets.dim() != 1 or resets.dtype != torch.int64:
            raise ValueError("resets must be int64 [n]")
    for name, t in (
        ("req_to_token", req_to_token),
        ("req_to_swa_token", req_to_swa_token),
        ("mapping", mapping),
        ("input_ids", input_ids),
        ("dest", dest),
        ("resets", resets),
    ):
        if t is not None and t.device != block.device:
            raise ValueError(f"{name} is on {t.device}, block on {block.device}")
    for _, slots in extras.scrubs:
        if slots.dim() != 1 or slots.dtype != torch.int64 or slots.device != block.device:
            raise ValueError(f"scrub slots must be int64 [n] on {block.device}")


def write_decode_rows_native(
    block: torch.Tensor,
    req_to_token: torch.Tensor,
    req_to_swa_token: torch.Tensor | None = None,
    mapping: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    extras: StepExtras = _NONE,
) -> None:
    """`write_decode_rows` in torch ops (the reference); scrubs through each pool's
    `zero_slots`."""
    _check(block, req_to_token, req_to_swa_token, mapping, input_ids, extras)
    for pool, slots in extras.scrubs:
        pool.zero_slots(slots)
    if input_ids is not None:
        block[0].copy_(input_ids)
        if extras.host_ids is not None:
            extras.host_ids.copy_(input_ids)
    rows, slots, pos = block[1], block[3], block[4]
    req_to_token[rows, pos] = slots.to(torch.int32)
    if req_to_swa_token is not None and mapping is not None:
        if extras.resets is not None:
            mapping[extras.resets] = -1
        req_to_swa_token[rows, pos] = block[5].to(torch.int32)
        mapping[slots] = block[5]
    if extras.dest is not None:
        extras.dest.copy_(block)


@dataclass(frozen=True)
class _ScrubLaunch:
    """The kernel's scrub part: its pointers (two groups of three), integers (two pairs),
    constexprs and programs."""

    ptrs: tuple
    ints: tuple
    constexprs: dict[str, int]
    programs: int


def _scrub_launch(
    scrubs: Sequence[tuple[Any, torch.Tensor]], block: torch.Tensor
) -> _ScrubLaunch | None:
    """The kernel's scrub part for up to two scrubs whose pools have a `scrub_table` (None: the
    pools zero their slots themselves)."""
    tables: list[SlotTable] = []
    for pool, _ in scrubs:
        table = getattr(pool, "scrub_table", lambda: None)()
        if table is None:
            return None
        tables.append(table)
    if len(scrubs) > 2:
        return None
    ptrs: list = []
    ints: list = []
    meta: dict[str, int] = {"SCRUBS": len(scrubs)}
    programs = 0
    for j, name in enumerate("AB"):
        if j < len(scrubs):
            t, slots = tables[j], scrubs[j][1]
            n, bufs = slots.shape[0], t.bases.shape[0]
            ptrs += [t.bases, t.row_words, slots]
            ints += [n, bufs]
            meta[f"BLOCK_{name}"] = row_block(t)
            meta[f"BITS_{name}"] = t.word_bits
            programs += n * bufs  # one a (slot, buffer)
        else:
            ptrs += [block, block, block]  # never read
            ints += [0, 0]
    return _ScrubLaunch(tuple(ptrs), tuple(ints), meta, programs)


def write_decode_rows(
    block: torch.Tensor,
    req_to_token: torch.Tensor,
    req_to_swa_token: torch.Tensor | None = None,
    mapping: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    extras: StepExtras = _NONE,
    *,
    use_kernel: bool | None = None,
) -> None:
    """Write a decode step's new slots into the request tables, in one launch on CUDA.

    Parameters
    ----------
    block : int64 [5, B] (uniform pool) or [6, B] (hybrid pool), contiguous, on the tables'
        device: input ids, request rows, sequence lengths, new full slots, positions (and new
        window slots). Rows and positions must index `req_to_token` and slots `mapping` (the
        caller's invariant: ScheduleBatch built them; the kernel skips entries outside the
        tables rather than write past them, the torch ops raise IndexError).
    req_to_token : int32 [rows, ctx]; `req_to_token[row, pos] = slot` per request.
    req_to_swa_token : int32 [rows, ctx] or None; with a hybrid pool, `[row, pos] = window slot`.
    mapping : int64 [full slots] or None (with req_to_swa_token); `mapping[slot] = window slot`.
    input_ids : int64 [B] or None; copied into block row 0 (the overlapped decode's ids from
        the step still running), after everything queued before on the stream.
    extras : StepExtras, each part optional:
        dest : int64 [5 or 6, B], rows contiguous at any stride, on the block's device:
            receives the block (with the ids), e.g. the decode graph's static inputs.
        host_ids : int64 [B] pinned host memory (needs input_ids): receives input_ids.
        resets : int64 [n] full slots (hybrid pool) whose mapping entry becomes -1. None of
            them may be one of this step's new slots (the caller's invariant: the kernel's
            order between the two is not defined).
        scrubs : (pool, int64 [n] slots on the block's device) pairs: the slots are zeroed in
            every layer (`pool.zero_slots`); in the same launch for up to two pools with a
            `scrub_table`, else by the pools before it.
    use_kernel : None: the Triton kernel on CUDA, torch ops elsewhere; True: the kernel on any
        device (tests run it under TRITON_INTERPRET on the CPU).
    """
    if not (block.device.type == "cuda" if use_kernel is None else use_kernel):
        write_decode_rows_native(block, req_to_token, req_to_swa_token, mapping, input_ids, extras)
        return
    _check(block, req_to_token, req_to_swa_token, mapping, input_ids, extras)
    scrub = _scrub_launch(extras.scrubs, block)
    if scrub is None:
        for pool, slots in extras.scrubs:
            pool.zero_slots(slots)
        scrub = _scrub_launch((), block)
        assert scrub is not None
    b = block.shape[1]
    resets, dest, host = extras.resets, extras.dest, extras.host_ids
    n_resets = 0 if resets is None else resets.shape[0]
    row_programs = -(-max(b, n_resets) // _BLOCK)
    programs = row_programs + scrub.programs
    if programs == 0:
        return
    swa = req_to_swa_token is not None
    cached_launcher(_decode_rows_kernel)[(programs,)](
        block,
        block if input_ids is None else input_ids,  # any pointer when unused
        req_to_token,
        req_to_token if req_to_swa_token is None else req_to_swa_token,
        block if mapping is None else mapping,
        block if dest is None else dest,
        block if host is None else host,
        block if resets is None else resets,
        *scrub.ptrs,
        b,
        req_to_token.stride(0),
        0 if req_to_swa_token is None else req_to_swa_token.stride(0),
        req_to_token.shape[0],
        req_to_token.shape[1],
        0 if mapping is None else mapping.shape[0],
        0 if dest is None else dest.stride(0),
        n_resets,
        row_programs,
        *scrub.ints,
        HAS_IDS=input_ids is not None,
        HAS_SWA=swa,
        HAS_DEST=dest is not None,
        HAS_HOST=host is not None,
        ROWS=block.shape[0],
        BLOCK=_BLOCK,
        **scrub.constexprs,
    )

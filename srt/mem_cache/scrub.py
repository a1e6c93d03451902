"""Zero some slots of every layer's K and V buffer in one kernel launch.

The allocator scrubs every page it hands out (`scrub_on_alloc`), which on the decode path means
every step. Indexing each layer's buffers separately costs two launches (and, with `b[idx] = 0`,
a host-to-device copy of the 0) per layer per step; this kernel reads the buffers' base addresses
from a device table built once (the pool never reallocates its buffers) and zeroes the slots of
all of them at once.

Only for buffers whose slots are rows of one fixed byte stride (per-layer `[slots, H, D]` or
`[pages, page_size, H, D]` contiguous buffers): slot s occupies bytes
[s * row_bytes, (s + 1) * row_bytes) of its buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_ext.launch import cached_launcher, next_pow2

_MAX_BLOCK = 1024  # words one program stores per loop iteration


@triton.jit
def zero_slot_row(Bases, RowWords, Slots, i, b, BLOCK: tl.constexpr, WORD_BITS: tl.constexpr):
    """Zero slot Slots[i] of buffer b of a SlotTable (its base address Bases[b], RowWords[b]
    words of WORD_BITS a slot)."""
    slot = tl.load(Slots + i).to(tl.int64)
    n = tl.load(RowWords + b)  # int64 words per slot of this buffer
    if WORD_BITS == 64:
        base = tl.load(Bases + b).to(tl.pointer_type(tl.int64))
    elif WORD_BITS == 32:
        base = tl.load(Bases + b).to(tl.pointer_type(tl.int32))
    elif WORD_BITS == 16:
        base = tl.load(Bases + b).to(tl.pointer_type(tl.int16))
    else:
        base = tl.load(Bases + b).to(tl.pointer_type(tl.int8))
    row = base + slot * n
    w = tl.arange(0, BLOCK)
    for c in range(0, n, BLOCK):
        tl.store(row + c + w, tl.zeros([BLOCK], dtype=row.dtype.element_ty), mask=c + w < n)


@triton.jit
def _zero_slots_kernel(Bases, RowWords, Slots, BLOCK: tl.constexpr, WORD_BITS: tl.constexpr):
    # program (slot position in Slots, buffer)
    zero_slot_row(Bases, RowWords, Slots, tl.program_id(0), tl.program_id(1), BLOCK, WORD_BITS)


@dataclass(frozen=True)
class SlotTable:
    """Device table of buffers for `zero_slots_all`: base addresses and words per slot (int64
    [n_bufs] each), the word size in bits and the largest row in words."""

    bases: torch.Tensor
    row_words: torch.Tensor
    word_bits: int
    max_words: int


def slot_table(buffers: list[torch.Tensor]) -> SlotTable | None:
    """The table for `buffers` (contiguous, one device), or None when a buffer's slots are not
    rows of one byte stride (then index them one by one)."""
    if not buffers or any(not b.is_contiguous() for b in buffers):
        return None
    rows = [b.stride(1 if b.ndim == 4 else 0) * b.element_size() for b in buffers]  # bytes/slot
    addrs = [b.data_ptr() for b in buffers]
    word = next(w for w in (8, 4, 2, 1) if all(x % w == 0 for x in rows + addrs))
    dev = buffers[0].device
    return SlotTable(
        torch.tensor(addrs, dtype=torch.int64, device=dev),
        torch.tensor([r // word for r in rows], dtype=torch.int64, device=dev),
        word * 8,
        max(rows) // word,
    )


def row_block(table: SlotTable) -> int:
    """The words one program of `zero_slot_row` stores per loop iteration for `table`."""
    return min(_MAX_BLOCK, next_pow2(table.max_words))


def zero_slots_all(table: SlotTable, slots: torch.Tensor) -> None:
    """Zero `slots` (int64 [n], on the buffers' device, each < the buffers' slot count) in every
    buffer of `table`; one launch."""
    n = slots.shape[0]
    if n == 0:
        return
    block = row_block(table)  # host ints, per decode step
    grid = (n, table.bases.shape[0])
    cached_launcher(_zero_slots_kernel)[grid](  # direct launch: every decode step scrubs
        table.bases, table.row_words, slots, BLOCK=block, WORD_BITS=table.word_bits
    )

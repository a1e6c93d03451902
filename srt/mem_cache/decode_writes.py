"""A decode step's table writes in one launch.

Each decode step writes, for every request, its new token's KV slot into the request's row of
`req_to_token` (and, with a hybrid pool, the window slot into `req_to_swa_token` and into the
full -> window mapping), and, in the overlapped decode, copies the previous step's ids into
the step's input ids. As torch ops that is an index cast and an `index_put` per table, a
device copy, and the mapping's own uploads: ~10 launches of ~2.5 µs each between two decode
graphs. `write_decode_rows` reads everything from the step's decode block (one upload) in one
kernel; `write_decode_rows_native` is the same writes in torch (CPU, and the test oracle).

The block is `ScheduleBatch.prepare_for_decode`'s int64 [5 or 6, B]: input ids, request rows,
sequence lengths, new slots, positions (and new window slots), each row contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_ext.triton.launcher import cached_launcher

_BLOCK = 128  # requests a program writes


@triton.jit
def _decode_rows_kernel(
    Block,  # int64 [R, B]: ids, rows, seq_lens, slots, positions (, window slots)
    B,
    Ids,  # int64 [B] ids to copy into block row 0 (HAS_IDS)
    ReqToToken,  # int32 [rows, ctx] (both tables of one shape)
    r2t_stride,
    ReqToSwa,  # int32 [rows, ctx] (HAS_SWA)
    r2s_stride,
    Mapping,  # int64 [full slots] full -> window slot (HAS_SWA)
    n_rows,
    ctx,
    n_map,
    HAS_IDS: tl.constexpr,
    HAS_SWA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < B
    row = tl.load(Block + B + i, mask=m, other=0)
    slot = tl.load(Block + 3 * B + i, mask=m, other=0)
    pos = tl.load(Block + 4 * B + i, mask=m, other=0)
    if HAS_IDS:
        tl.store(Block + i, tl.load(Ids + i, mask=m, other=0), mask=m)
    # the caller's invariant keeps every entry inside the tables; these bounds only make sure
    # a broken one cannot write outside them
    cell = m & (row >= 0) & (row < n_rows) & (pos >= 0) & (pos < ctx)
    tl.store(ReqToToken + row * r2t_stride + pos, slot.to(tl.int32), mask=cell)
    if HAS_SWA:
        swa = tl.load(Block + 5 * B + i, mask=m, other=0)
        tl.store(ReqToSwa + row * r2s_stride + pos, swa.to(tl.int32), mask=cell)
        tl.store(Mapping + slot, swa, mask=m & (slot >= 0) & (slot < n_map))


def _check(
    block: torch.Tensor,
    req_to_token: torch.Tensor,
    req_to_swa_token: torch.Tensor | None,
    mapping: torch.Tensor | None,
    input_ids: torch.Tensor | None,
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
        raise ValueError(f"input_ids must be int64 [{b}], got {input_ids.dtype} "
                         f"{tuple(input_ids.shape)}")  # fmt: skip
    for name, t in (("req_to_token", req_to_token), ("req_to_swa_token", req_to_swa_token),
                    ("mapping", mapping), ("input_ids", input_ids)):  # fmt: skip
        if t is not None and t.device != block.device:
            raise ValueError(f"{name} is on {t.device}, block on {block.device}")


def write_decode_rows_native(
    block: torch.Tensor,
    req_to_token: torch.Tensor,
    req_to_swa_token: torch.Tensor | None = None,
    mapping: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
) -> None:
    """`write_decode_rows` in torch ops (the reference)."""
    _check(block, req_to_token, req_to_swa_token, mapping, input_ids)
    if input_ids is not None:
        block[0].copy_(input_ids)
    rows, slots, pos = block[1], block[3], block[4]
    req_to_token[rows, pos] = slots.to(torch.int32)
    if req_to_swa_token is not None and mapping is not None:
        req_to_swa_token[rows, pos] = block[5].to(torch.int32)
        mapping[slots] = block[5]


def write_decode_rows(
    block: torch.Tensor,
    req_to_token: torch.Tensor,
    req_to_swa_token: torch.Tensor | None = None,
    mapping: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
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
    use_kernel : None: the Triton kernel on CUDA, torch ops elsewhere; True: the kernel on any
        device (tests run it under TRITON_INTERPRET on the CPU).
    """
    if not (block.device.type == "cuda" if use_kernel is None else use_kernel):
        write_decode_rows_native(block, req_to_token, req_to_swa_token, mapping, input_ids)
        return
    _check(block, req_to_token, req_to_swa_token, mapping, input_ids)
    b = block.shape[1]
    if b == 0:
        return
    swa = req_to_swa_token is not None
    cached_launcher(_decode_rows_kernel)[((b + _BLOCK - 1) // _BLOCK,)](
        block,
        b,
        block if input_ids is None else input_ids,  # any pointer when unused
        req_to_token,
        req_to_token.stride(0),
        req_to_token if req_to_swa_token is None else req_to_swa_token,
        0 if req_to_swa_token is None else req_to_swa_token.stride(0),
        block if mapping is None else mapping,
        req_to_token.shape[0],
        req_to_token.shape[1],
        0 if mapping is None else mapping.shape[0],
        HAS_IDS=input_ids is not None,
        HAS_SWA=swa,
        BLOCK=_BLOCK,
    )

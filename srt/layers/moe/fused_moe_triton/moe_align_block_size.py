"""Group token-expert pairs by expert, each expert's run padded to the GEMM block size.

Pair i is (token i // k, its (i % k)-th expert), i in [0, T*k). The alignment lays the pairs out
expert by expert (pair order kept inside an expert), each expert's run padded up to a multiple of
BLOCK_M with the sentinel T*k, so every GEMM block of BLOCK_M rows belongs to one expert.

Graph-safe: one Triton program, static buffer sizes from (T*k, E, BLOCK_M) only, no host sync.
The padded size is at most T*k + min(T*k, E) * (BLOCK_M - 1) (only experts with a pair are
padded); the number actually used is written to a device scalar the GEMMs read, and their blocks
past it exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MoeAlignment:
    """Pairs grouped by expert, as the grouped GEMMs read them.

    Attributes
    ----------
    sorted_token_ids : int32 [max_blocks * block_m]; pair index per padded row, T*k = padding.
    expert_ids : int32 [max_blocks]; each block's expert, -1 past the used blocks.
    num_tokens_post_padded : int32 [1]; padded rows in use (a multiple of block_m).
    block_m : rows per block.
    num_pairs : T*k.
    """

    sorted_token_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.shape[0]


def max_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of BLOCK_M blocks for num_pairs pairs over num_experts experts."""
    padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(padded, block_m)


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_pad_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, CHUNK)
    # 1. pairs per expert
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pair = start + lanes
        ids = tl.load(topk_ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        counts += tl.sum(hit, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD]
    ends = tl.cumsum(padded, axis=0)  # [E_PAD], inclusive
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_post_pad_ptr, total)
    # 2. each block's expert (-1 past the used blocks), and the padding sentinel everywhere
    for b0 in range(0, max_blocks, CHUNK):
        blk = b0 + lanes
        row = blk * BLOCK_M
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)  # [CHUNK]
        owner = tl.where(row < total, owner, -1)
        tl.store(expert_ids_ptr + blk, owner, mask=blk < max_blocks)
    for r0 in range(0, max_blocks * BLOCK_M, CHUNK):
        rows = r0 + lanes
        sentinel = tl.zeros([CHUNK], dtype=tl.int32) + num_pairs
        tl.store(sorted_ids_ptr + rows, sentinel, mask=rows < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the sentinel stores land before other threads overwrite them
    # 3. scatter each pair to its expert's run, in pair order
    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        pair = start + lanes
        ids = tl.load(topk_ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        hit = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        before = tl.cumsum(hit, axis=0) - hit  # same-expert pairs earlier in the chunk
        dest = tl.sum(hit * (before + (starts + seen)[None, :]), axis=1)  # [CHUNK]
        ok = (pair < num_pairs) & (tl.sum(hit, axis=1) > 0)
        tl.store(sorted_ids_ptr + dest, pair, mask=ok)
        seen += tl.sum(hit, axis=0)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the pairs of `topk_ids` by expert, padded per expert to `block_m` rows.

    Parameters
    ----------
    topk_ids : int32/int64 [T, k]; expert ids in [0, num_experts) (others are dropped).
    num_experts : E.
    block_m : the GEMM's rows per block (a power of two >= 16).

    Returns
    -------
    MoeAlignment (buffers on topk_ids.device).
    """
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"topk_ids must be int32/int64 [T, k], got {topk_ids.dtype} {topk_ids.shape}"
        )
    num_pairs = topk_ids.numel()
    max_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_post_pad = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        topk_ids.contiguous(),
        sorted_ids,
        expert_ids,
        num_post_pad,
        num_pairs,
        num_experts,
        max_blocks,
        BLOCK_M=block_m,
        E_PAD=triton.next_power_of_2(num_experts),
        CHUNK=256 if num_experts <= 64 else 64,
        num_warps=4,
    )
    return MoeAlignment(sorted_ids, expert_ids, num_post_pad, block_m, num_pairs)

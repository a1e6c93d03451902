"""The one-launch scrub of every layer's K/V slots (srt/mem_cache/scrub.py).

On CPU the Triton kernel runs under TRITON_INTERPRET=1; on CUDA the pool's zero_slots uses it.
"""

import os

import pytest
import torch

from srt.mem_cache.memory_pool import MHATokenToKVPool

DEV = "cuda" if torch.cuda.is_available() else "cpu"
interp = pytest.mark.skipif(
    DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton kernel needs CUDA or TRITON_INTERPRET=1",
)


def _buffers(shapes, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # random non-zero contents, so every zero in the result was written by the kernel
    return [(torch.rand(s, generator=g) * 100 + 1).to(DEV, dtype) for s in shapes]


@interp
@pytest.mark.parametrize(
    "shapes, dtype",
    [
        ([(33, 3, 8), (33, 3, 8), (33, 3, 5), (33, 3, 5)], torch.bfloat16),  # K 8 / V 5 wide
        ([(9, 4, 1, 7)] * 3, torch.float32),  # paged [pages, ps, H, D], ps 4
        ([(257, 1, 1)] * 2, torch.uint8),  # one-byte rows: 8-bit words
    ],
)
def test_zero_slots_all_zeroes_exactly_the_slots_of_every_buffer(shapes, dtype):
    from srt.mem_cache.scrub import slot_table, zero_slots_all

    bufs = _buffers(shapes, dtype, seed=len(shapes))
    before = [b.clone() for b in bufs]
    table = slot_table(bufs)
    assert table is not None
    n_slots = bufs[0].shape[0] * (bufs[0].shape[1] if bufs[0].ndim == 4 else 1)
    slots = torch.tensor([0, 5, n_slots - 1, 7], dtype=torch.int64, device=DEV)
    zero_slots_all(table, slots)
    for b, b0 in zip(bufs, before, strict=True):
        rows = b.reshape(n_slots, -1)  # [slots, H * D]
        rows0 = b0.reshape(n_slots, -1)
        keep = torch.ones(n_slots, dtype=torch.bool, device=DEV)
        keep[slots] = False
        assert not rows[slots].any()
        assert torch.equal(rows[keep], rows0[keep])


def test_slot_table_refuses_strided_buffers():
    from srt.mem_cache.scrub import slot_table

    b = torch.zeros(8, 2, 2, 4)[:, :, 0]  # [slots, 2, 4] with a gap between slots
    assert slot_table([b]) is None
    assert slot_table([]) is None


@pytest.mark.skipif(DEV != "cuda", reason="the pool uses the kernel on CUDA only")
@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_zero_slots_on_cuda_matches_the_indexed_path(page_size):
    """zero_slots through the kernel leaves the same bytes as the per-layer indexing on CPU."""
    pools = [
        MHATokenToKVPool(64, page_size, torch.bfloat16, 2, 16, 3, dev, v_head_dim=8)
        for dev in ("cuda", "cpu")
    ]
    g = torch.Generator().manual_seed(page_size)
    for pool in pools:
        for b in pool.k_buffer + pool.v_buffer:
            b.copy_(torch.rand(b.shape, generator=g) + 0.5)
        g.manual_seed(page_size)
    slots = torch.tensor([1, 17, 40, 63], dtype=torch.int64)
    for pool in pools:
        pool.zero_slots(slots)
    torch.cuda.synchronize()
    from srt.mem_cache.scrub import SlotTable

    assert isinstance(pools[0]._slot_table, SlotTable)  # the kernel ran, not the fallback
    gpu, cpu = (p.k_buffer + p.v_buffer for p in pools)
    for a, b in zip(gpu, cpu, strict=True):
        assert torch.equal(a.cpu(), b)

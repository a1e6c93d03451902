"""Test harness: a minimal KV pool stand-in, a req_to_token table and ForwardBatch builders.

This drives forward passes of single layers and models in tests, without the model runner.
Pages are handed out in a shuffled order so page arithmetic is exercised.
"""

from __future__ import annotations

import random

import torch

from sgl_ext import set_kv_buffer
from srt.mem_cache.memory_pool import MHATokenToKVPool
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, compute_extend_metadata


class StandInKVPool:
    """Same interface as srt.mem_cache.memory_pool.MHATokenToKVPool (zeroed, slot 0 = padding)."""

    def __init__(
        self, size, page_size, dtype, head_num, head_dim, layer_num, device, v_head_dim=None
    ):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim, self.layer_num = head_num, head_dim, layer_num
        num_pages = size // page_size + 1  # page 0 holds the padding slot 0
        vd = v_head_dim or head_dim
        if page_size == 1:
            ks, vs = (num_pages, head_num, head_dim), (num_pages, head_num, vd)
        else:
            ks = (num_pages, page_size, head_num, head_dim)
            vs = (num_pages, page_size, head_num, vd)
        self.k_buffer = [torch.zeros(ks, dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros(vs, dtype=dtype, device=device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale=None, v_scale=None):
        lid = layer.layer_id
        set_kv_buffer(
            cache_k, cache_v, self.k_buffer[lid], self.v_buffer[lid], loc, k_scale, v_scale
        )


def make_kv_pool(size, page_size, dtype, head_num, head_dim, layer_num, device, real=True, **kw):
    """The real MHATokenToKVPool, or with real=False the minimal stand-in above."""
    if real:
        return MHATokenToKVPool(size, page_size, dtype, head_num, head_dim, layer_num, device, **kw)
    return StandInKVPool(size, page_size, dtype, head_num, head_dim, layer_num, device)


class ReqToTokenTable:
    """Stand-in ReqToTokenPool: int32 [max_reqs, max_ctx] of KV slots."""

    def __init__(self, max_reqs, max_ctx, device):
        self.req_to_token = torch.zeros(max_reqs, max_ctx, dtype=torch.int32, device=device)


class Harness:
    """Allocates slots per request and builds EXTEND / DECODE ForwardBatches."""

    def __init__(
        self,
        kv_pool,
        backend,
        max_reqs=8,
        max_ctx=256,
        device="cpu",
        enable_fused_rope_kv=True,
        seed=0,
    ):
        self.pool, self.backend, self.device = kv_pool, backend, torch.device(device)
        self.r2t = ReqToTokenTable(max_reqs, max_ctx, self.device)
        if getattr(backend, "req_to_token_pool", 1) is None:
            backend.req_to_token_pool = self.r2t
        self.ps = kv_pool.page_size
        num_pages = kv_pool.size // self.ps + 1
        self.free_pages = list(range(1, num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.fused = enable_fused_rope_kv

    def _alloc(self, row: int, n: int) -> list[int]:
        start = self.lens.get(row, 0)
        pages = self.pages.setdefault(row, [])
        slots = []
        for i in range(start, start + n):
            if i // self.ps >= len(pages):
                pages.append(self.free_pages.pop())
            slots.append(pages[i // self.ps] * self.ps + i % self.ps)
        self.r2t.req_to_token[row, start : start + n] = torch.tensor(slots, dtype=torch.int32)
        self.lens[row] = start + n
        return slots

    def _batch(self, mode, rows, ids, slots, **kw):
        dev = self.device
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=dev),
            out_cache_loc=torch.tensor(slots, dtype=torch.int64, device=dev),
            req_to_token_pool=self.r2t,
            token_to_kv_pool=self.pool,
            attn_backend=self.backend,
            enable_fused_rope_kv=self.fused,
            **kw,
        )
        self.backend.init_forward_metadata(fb)
        return fb

    def extend(self, rows: list[int], token_lists: list[list[int]]) -> ForwardBatch:
        prefix = [self.lens.get(r, 0) for r in rows]
        slots = [s for r, t in zip(rows, token_lists, strict=True) for s in self._alloc(r, len(t))]
        md = compute_extend_metadata(prefix, [len(t) for t in token_lists], self.device)
        ids = [x for t in token_lists for x in t]
        return self._batch(ForwardMode.EXTEND, rows, ids, slots, **md)

    def decode(self, rows: list[int], tokens: list[int]) -> ForwardBatch:
        slots = [self._alloc(r, 1)[0] for r in rows]
        lens = [self.lens[r] for r in rows]
        return self._batch(
            ForwardMode.DECODE,
            rows,
            tokens,
            slots,
            seq_lens=torch.tensor(lens, dtype=torch.int64, device=self.device),
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int64),
            seq_lens_sum=sum(lens),
        )

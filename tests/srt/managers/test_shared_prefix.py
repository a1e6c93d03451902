"""Cascade decode (issue 48): which running requests share leading KV pages
(`find_shared_prefixes`), and the Engine's greedy tokens with the shared prefix read once per
group equal those with every request's KV read whole (Triton backend; CPU: the interpreter)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

import srt
from srt.layers.attention import triton_backend
from srt.managers import shared_prefix
from srt.managers.shared_prefix import SharedPrefixFinder, find_shared_prefixes
from srt.model_executor.forward_batch_info import SharedPrefixes
from tests.conftest import gpu


@dataclass
class _R:  # what find_shared_prefixes reads of a Req
    kv_pages: list[int]
    cache_protected_len: int
    kv_len: int
    req_pool_idx: int
    rid: int = 0
    extra: dict = field(default_factory=dict)


def _tree_pages(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(10_000, 100_000), n)


@pytest.mark.parametrize("ps", [1, 16])
def test_groups_share_exactly_their_common_tree_pages(ps, monkeypatch):
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_TOKENS", 256)
    rng = random.Random(ps)
    sys_a, sys_b = _tree_pages(rng, 300 // ps + 1), _tree_pages(rng, 260 // ps + 2)
    reqs, want = [], {}
    for i in range(11):
        a = i % 3 != 2  # rows 2, 5, 8: group b
        base = sys_a if a else sys_b
        own = _tree_pages(rng, rng.randrange(1, 5))  # the request's own question pages
        protected = (len(base) + (len(own) if i % 2 else 0)) * ps  # some inserted theirs
        kv_len = (len(base) + len(own)) * ps + rng.randrange(1, ps + 1)
        reqs.append(_R(base + own, protected, kv_len, 40 + i))
        want.setdefault(a, []).append(i)
    reqs.append(_R(_tree_pages(rng, 30), 20 * ps, 30 * ps, 99))  # shares nothing
    reqs.append(_R(sys_a[:3] + _tree_pages(rng, 40), 43 * ps, 43 * ps + 1, 98))  # 3 pages only
    got = find_shared_prefixes(reqs, ps)
    assert got is not None
    found = zip(got.rows, got.prefix_lens, got.req_pool_indices, strict=True)
    groups = {g: (n, owner) for g, n, owner in found}
    assert set(groups) == {tuple(want[True]), tuple(want[False])}
    assert groups[tuple(want[True])][0] == len(sys_a) * ps
    assert groups[tuple(want[False])][0] == len(sys_b) * ps
    for rows, (n, owner) in groups.items():  # the owner's row holds the same pages
        owner_req = next(r for r in reqs if r.req_pool_idx == owner)
        assert all(reqs[i].kv_pages[: n // ps] == owner_req.kv_pages[: n // ps] for i in rows)
        assert all(n <= reqs[i].kv_len - 1 for i in rows)


def test_short_or_unprofitable_prefixes_are_not_grouped(monkeypatch):
    rng = random.Random(0)
    sys = _tree_pages(rng, 100)
    two = [_R(sys + _tree_pages(rng, 2), 100, 103, i) for i in range(2)]
    assert find_shared_prefixes(two, 1) is None  # 100 tokens < MIN_SHARED_TOKENS
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 64)
    assert find_shared_prefixes(two, 1) is None  # saves 100 reads < MIN_SAVED_TOKENS
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_TOKENS", 100)
    got = find_shared_prefixes(two, 1)
    assert got is not None and got.rows == ((0, 1),) and got.prefix_lens == (100,)
    # an outlier sharing only the first pages does not cut the others' prefix
    odd = _R(sys[:30] + _tree_pages(rng, 80), 110, 111, 7)  # 3 x 30 saved < 2 x 100
    got = find_shared_prefixes([*two, odd, _R(sys + [5], 101, 102, 8)], 1)
    assert got is not None and got.rows == ((0, 1, 3),) and got.prefix_lens == (100,)
    # the new token is never part of the prefix (kv_len counts it)
    tight = [_R(sys, 100, 100, i) for i in range(3)]
    got = find_shared_prefixes(tight, 1)
    assert got is not None and got.prefix_lens == (99,)


def test_finder_recomputes_exactly_when_the_batch_or_its_tree_lengths_change(monkeypatch):
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", 64)
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_TOKENS", 64)
    calls = []
    real = shared_prefix.find_shared_prefixes
    monkeypatch.setattr(
        shared_prefix, "find_shared_prefixes", lambda r, ps: calls.append(1) or real(r, ps)
    )
    rng = random.Random(3)
    sys = _tree_pages(rng, 100)
    reqs = [_R(sys + _tree_pages(rng, 3), 100, 104 + i, i) for i in range(3)]
    finder = SharedPrefixFinder()
    first = finder.find(reqs, 1)
    assert first is not None and first.prefix_lens == (100,)
    for r in reqs:  # decode steps: only kv_len grows
        r.kv_len += 1
    assert finder.find(list(reqs), 1) is first and len(calls) == 1
    reqs[1].cache_protected_len = 103  # its own pages went into the tree
    assert finder.find(reqs, 1) is not first and len(calls) == 2
    twin = _R(list(reqs[2].kv_pages), 100, reqs[2].kv_len, 2)  # equal fields, another request
    finder.find(reqs[:2] + [twin], 1)
    assert len(calls) == 3
    finder.find(reqs[:2], 1)  # one left the batch
    assert len(calls) == 4


def test_graph_buffers_take_the_groups_or_refuse_untouched():
    """A cascade graph's buffers: the batch's groups laid out as the kernels read them (rows
    past the batch's in no group, empty work items); more work items than the graph holds
    (only groups of one request could need them) leave the buffers as they were."""
    be = triton_backend.TritonAttnBackend(device="cpu")
    bs = 8
    n = 2 * bs + 4 * triton_backend.cascade_items_bound(bs)
    flat = torch.full((n,), -7, dtype=torch.int32)
    be._cascade_bufs[bs] = flat
    assert be.replay_cascade_cuda_graph(bs, SharedPrefixes(((0, 1, 2), (4, 3)), (16, 32), (5, 6)))
    got = triton_backend.cascade_views(flat, bs)
    assert got.prefix_lens.tolist() == [16, 16, 16, 32, 32, 0, 0, 0]
    assert got.rows.tolist()[:5] == [0, 1, 2, 4, 3]
    assert got.items[:2].tolist() == [[0, 3, 16, 5], [3, 5, 32, 6]]
    assert not got.items[2:].any()
    groups = SharedPrefixes(((0, 1, 2), (4, 3)), (16, 32), (5, 6))
    assert be.replay_cascade_cuda_graph(bs, groups)
    held = flat.clone()
    flat.fill_(-7)  # the same groups again: the buffers already hold them (no upload)
    assert be.replay_cascade_cuda_graph(bs, groups)
    assert (flat == -7).all()
    assert be.replay_cascade_cuda_graph(bs, SharedPrefixes(groups.rows, (16, 32), (5, 6)))
    assert torch.equal(flat, held)  # other groups (equal here): written again
    before = flat.clone()
    singles = SharedPrefixes(tuple((i,) for i in range(bs)), (16,) * bs, tuple(range(bs)))
    assert not be.replay_cascade_cuda_graph(bs, singles)
    assert torch.equal(flat, before)


# ---- the Engine: cascade on vs off -----------------------------------------------------------
SP = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def _prompts(seed: int, ps: int) -> list[list[int]]:
    rng = random.Random(seed)
    toks = lambda n: [rng.randrange(3, 999) for _ in range(n)]  # noqa: E731
    systems = [toks(3 * ps + 5), toks(2 * ps + 9)]
    return [systems[i % 2] + toks(rng.randrange(1, 9)) for i in range(9)] + [toks(7)]


def _run(monkeypatch, cascade: bool, ps: int, **kw) -> tuple[list[list[int]], int]:
    """Greedy ids of the prompts (the first two, then the rest: they match those prefixes),
    and how many decode steps ran the cascade (eager batches and graph replays)."""
    monkeypatch.setattr(shared_prefix, "MIN_SHARED_TOKENS", ps)
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_TOKENS", ps)
    seen = []
    real_args = triton_backend.cascade_args
    real_replay = triton_backend.TritonAttnBackend.replay_cascade_cuda_graph

    def counting_args(shared, batch_size, device):
        seen.append(shared)
        return real_args(shared, batch_size, device)

    def counting_replay(self, bs, shared):
        seen.append(shared)
        return real_replay(self, bs, shared)

    monkeypatch.setattr(triton_backend, "cascade_args", counting_args)
    monkeypatch.setattr(
        triton_backend.TritonAttnBackend, "replay_cascade_cuda_graph", counting_replay
    )
    kw.setdefault("disable_cuda_graph", True)
    eng = srt.Engine(
        skip_tokenizer_init=True,
        attention_backend="triton",
        page_size=ps,
        context_length=256,
        disable_cascade_attn=not cascade,
        **kw,
    )
    try:
        prompts = _prompts(ps, ps)
        outs = eng.generate(input_ids=prompts[:2], sampling_params=SP)
        outs += eng.generate(input_ids=prompts[2:], sampling_params=SP)
    finally:
        eng.shutdown()
    assert not any("error" in o for o in outs)
    return [o["output_ids"] for o in outs], len(seen)


@pytest.mark.parametrize("ps", [1, 4])
def test_engine_greedy_tokens_identical_with_cascade(monkeypatch, ps):
    kw = dict(device="cpu", max_total_tokens=2048)
    want, n_off = _run(monkeypatch, False, ps, **kw)
    got, n_on = _run(monkeypatch, True, ps, **kw)
    assert n_off == 0 and n_on > 0  # the cascade really ran
    assert got == want


@gpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_gpu_engine_greedy_tokens_identical_with_cascade(monkeypatch, kv, graphs):
    """The GPU, float32 (no near-tie flips), eager or CUDA graphs (8 requests decoding: the
    cascade graph of bucket 8, padded rows included): cascade on == off (unrun on CI)."""
    kw = dict(device="cuda", dtype="float32", kv_cache_dtype=kv, max_total_tokens=4096)
    kw["disable_cuda_graph"] = not graphs
    want, n_off = _run(monkeypatch, False, 16, **kw)
    got, n_on = _run(monkeypatch, True, 16, **kw)
    torch.cuda.synchronize()
    assert n_off == 0 and n_on > 0
    assert got == want

"""Stress of the radix cache through the scheduler (issue 48): hundreds of random requests per
configuration sharing a few prefixes (some ending exactly on a page, some namespaced by an
extra key), mid-flight aborts, a pool small enough that the tree is evicted, chunked prefill of
the longer prompts (chunks not a whole number of pages too), page sizes 1 and 16, bf16 and fp8
KV, fused and unfused RoPE + KV, the write check on (SGL_EXT_DEBUG).

Around every scheduler step: every slot someone reads before and after it (a cached prefix's,
a running request's written token's) keeps its K/V bytes, unless its page was freed in between
(evicted, then handed out again); every page is held by exactly one of the free list, the tree
and one running request, with exact sizes and locks. At the end the pool is whole again.

The hybrid sliding-window pool (tiny gpt-oss, window-left 4: `SWARadixCache`) runs the same
workload, its window pool checked the same way (the bytes of every window slot still read, the
window pages' ownership, locks and sizes, the full -> window mapping), with a window pool small
enough that the tree's window pages are tombstoned.
"""

from __future__ import annotations

import json
import random

import pytest

import srt
from sgl_ext import settings
from srt.managers.schedule_batch import Req
from srt.sampling.sampling_params import SamplingParams
from tests.conftest import gpu
from tests.srt.distributed.tp_harness import TINY_GPT_OSS
from tests.srt.mem_cache.radix_checks import (
    changed_slots,
    check_ownership,
    kv_bytes,
    referenced_slots,
)
from tests.srt.mem_cache.swa_radix_checks import (
    check_swa_ownership,
    swa_kv_bytes,
    swa_referenced_slots,
)

CONFIGS = [
    pytest.param(ps, kv, fused, "cpu", id=f"page{ps}-{kv}-{'fused' if fused else 'unfused'}")
    for ps in (1, 16)
    for kv in ("bf16", "fp8_e4m3")
    for fused in (True, False)
] + [
    pytest.param(ps, kv, True, "cuda", id=f"cuda-page{ps}-{kv}", marks=gpu)
    for ps in (1, 16)
    for kv in ("bf16", "fp8_e4m3")
]
SWA_CONFIGS = [p for p in CONFIGS if p.values[3] == "cpu"] + [
    pytest.param(ps, kv, True, "cuda", id=f"cuda-page{ps}-{kv}", marks=gpu)
    for ps in (1, 16)
    for kv in ("bf16", "fp8_e4m3")
]


class Tally:
    """What the run did (so the test knows it exercised hits, evictions and aborts)."""

    def __init__(self) -> None:
        self.evicted = self.aborted = self.freed_in_step = self.chunked = 0
        self.tombstoned = 0


def _workload(rng: random.Random, ps: int) -> list[list[int]]:
    toks = lambda n: [rng.randrange(3, 999) for _ in range(n)]  # noqa: E731
    return [toks(n) for n in (ps, 2 * ps, 2 * ps + 3, 5, 17, 33)]


def _new_req(rng: random.Random, rid: int, systems: list[list[int]]) -> Req:
    base = rng.choice(systems)
    ids = base[: rng.randrange(len(base) + 1)] + [rng.randrange(3, 999) for _ in range(3)]
    if rng.random() < 0.1:
        ids = list(base)  # exactly a system prompt
    params = SamplingParams(max_new_tokens=rng.randrange(1, 7), temperature=0.0, ignore_eos=True)
    return Req(rid, ids, params, extra_key="salt" if rng.random() < 0.15 else None)


def _stress(
    ps: int, kv: str, fused: bool, device: str, num_requests: int, seed: int, swa: bool = False
) -> Tally:
    rng = random.Random(seed)
    kw = {"json_model_override_args": json.dumps(TINY_GPT_OSS)} if swa else {}
    eng = srt.Engine(
        device=device,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype="auto" if kv == "bf16" else kv,
        page_size=ps,
        enable_fused_rope_kv=fused,
        context_length=128,
        max_total_tokens=(24 if swa else 48) * 16 if ps == 16 else 384,
        max_running_requests=12 if not swa else 4,  # (a small window pool: tombstones)
        chunked_prefill_size=11 if ps == 1 else 24,  # longer prompts go in chunks
        **kw,
    )
    sched, runner = eng.scheduler, eng.model_runner
    tree, alloc, pool = sched.tree_cache, runner.token_to_kv_pool_allocator, runner.token_to_kv_pool
    tally = Tally()
    freed: set[int] = set()
    freed_swa: set[int] = set()
    real_free, real_evict = alloc.free, tree.evict

    def free(idx):
        freed.update((idx.cpu() // ps).tolist())
        return real_free(idx)

    def evict(n):
        got = real_evict(n)
        tally.evicted += got
        return got

    alloc.free, tree.evict = free, evict
    if swa:
        real_free_swa, real_evict_swa = alloc.free_swa, tree.evict_swa

        def free_swa(idx, full):
            freed_swa.update((idx.cpu() // ps).tolist())
            return real_free_swa(idx, full)

        def evict_swa(n):
            got = real_evict_swa(n)
            tally.tombstoned += got
            return got

        alloc.free_swa, tree.evict_swa = free_swa, evict_swa
    full_pool = pool.full_kv_pool if swa else pool
    systems = _workload(rng, ps)
    reqs: list[Req] = []
    with settings.override(debug=True):
        while len(reqs) < num_requests or sched.has_work():
            for _ in range(rng.randrange(0, 6) if len(reqs) < num_requests else 0):
                reqs.append(_new_req(rng, len(reqs), systems))
                sched.add_request(reqs[-1])
            live = [r for r in (*sched.waiting, *sched.running) if not r.finished]
            if live and rng.random() < 0.25:  # a client leaves mid-flight
                tally.aborted += sched.abort(rng.choice(live).rid) is not None
            before = kv_bytes(full_pool)
            read_before = referenced_slots(tree, sched.running, ps)
            if swa:
                before_swa = swa_kv_bytes(pool)
                read_before_swa = swa_referenced_slots(tree, sched.running, ps)
            freed.clear()
            freed_swa.clear()
            sched.step()
            tally.chunked += sched.chunked_req is not None
            tally.freed_in_step += len(freed)
            read = read_before & referenced_slots(tree, sched.running, ps)
            read -= {p * ps + i for p in freed for i in range(ps)}
            assert changed_slots(before, kv_bytes(full_pool), read) == [], "cached K/V changed"
            if swa:
                read = read_before_swa & swa_referenced_slots(tree, sched.running, ps)
                read -= {p * ps + i for p in freed_swa for i in range(ps)}
                after = swa_kv_bytes(pool)
                assert changed_slots(before_swa, after, read) == [], "window K/V changed"
                check_swa_ownership(tree, alloc, sched.running)
            else:
                check_ownership(tree, alloc, sched.running)
    assert all(r.finished and r.error is None for r in reqs), "a request failed"
    assert sched.num_prefill_steps > tally.chunked > 0
    assert tree.protected_size() == 0
    assert sched.available_kv_size() == runner.max_total_num_tokens
    if swa:
        assert tree.swa_protected_size() == 0
        free_swa_now = alloc.swa_available_size() + tree.swa_evictable_size()
        assert free_swa_now == alloc.size_swa
    assert runner.req_to_token_pool.available_size() == runner.max_running_requests
    tally.hit_rate = sched.cache_hit_rate()  # type: ignore[attr-defined]
    eng.shutdown()
    return tally


@pytest.mark.parametrize("ps, kv, fused, device", CONFIGS)
def test_random_shared_prefix_requests_keep_cached_kv_unchanged(ps, kv, fused, device):
    seed = random.randrange(2**32)
    num = 2000 if device == "cuda" else 500
    tally = _stress(ps, kv, fused, device, num, seed)
    assert tally.evicted > 0 and tally.aborted > 0, f"seed {seed}: nothing evicted or aborted"
    assert tally.hit_rate > 0.1, f"seed {seed}: too few prefix hits"  # type: ignore[attr-defined]


@pytest.mark.parametrize("ps, kv, fused, device", SWA_CONFIGS)
def test_hybrid_pool_shared_prefix_requests_keep_cached_kv_unchanged(ps, kv, fused, device):
    """The same on the hybrid sliding-window pool: both pools' cached bytes unchanged, window
    pages tombstoned under the window pool's pressure, and still prefix hits."""
    seed = random.randrange(2**32)
    num = 2000 if device == "cuda" else 400
    tally = _stress(ps, kv, fused, device, num, seed, swa=True)
    assert tally.evicted > 0 and tally.aborted > 0, f"seed {seed}: nothing evicted or aborted"
    assert tally.tombstoned > 0, f"seed {seed}: no window page was tombstoned"
    assert tally.hit_rate > 0.1, f"seed {seed}: too few prefix hits"  # type: ignore[attr-defined]
